import unittest

from pricing import MIN_ORDER_FOR_DISCOUNT, discount_amount, order_total


class DiscountAmountTest(unittest.TestCase):
    def test_percentage(self):
        self.assertEqual(discount_amount(80.0, 25), 20.0)

    def test_rounds_to_cents(self):
        self.assertEqual(discount_amount(10.0, 33), 3.3)

    def test_rejects_out_of_range(self):
        with self.assertRaises(ValueError):
            discount_amount(10.0, 120)
        with self.assertRaises(ValueError):
            discount_amount(10.0, -5)


class OrderTotalTest(unittest.TestCase):
    def test_small_order_gets_no_discount(self):
        self.assertEqual(order_total(40.0, shipping=5.0, percent=10), 45.0)

    def test_discount_without_shipping(self):
        self.assertEqual(order_total(100.0, percent=10), 90.0)

    def test_threshold_is_inclusive(self):
        self.assertEqual(order_total(MIN_ORDER_FOR_DISCOUNT, percent=10), 45.0)

    def test_discounted_order_still_pays_shipping(self):
        self.assertEqual(order_total(100.0, shipping=7.5, percent=10), 97.5)


if __name__ == "__main__":
    unittest.main()
