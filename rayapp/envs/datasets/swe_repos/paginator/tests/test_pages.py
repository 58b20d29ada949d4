import unittest

from paginator import page_count, paginate


class PageCountTest(unittest.TestCase):
    def test_partial_last_page_counts(self):
        self.assertEqual(page_count(11, 5), 3)

    def test_empty_list_has_one_page(self):
        self.assertEqual(page_count(0, 10), 1)
        self.assertEqual(paginate([], 1).items, [])

    def test_rejects_bad_page_size(self):
        with self.assertRaises(ValueError):
            page_count(10, 0)


class PaginateTest(unittest.TestCase):
    def setUp(self):
        self.items = list(range(25))

    def test_first_page(self):
        page = paginate(self.items, 1, 10)
        self.assertEqual(page.items, list(range(10)))
        self.assertTrue(page.has_next)
        self.assertFalse(page.has_previous)

    def test_partial_last_page(self):
        page = paginate(self.items, 3, 10)
        self.assertEqual(page.items, [20, 21, 22, 23, 24])
        self.assertFalse(page.has_next)
        self.assertTrue(page.has_previous)

    def test_page_past_the_end_raises(self):
        with self.assertRaises(ValueError):
            paginate(self.items, 4, 10)
        with self.assertRaises(ValueError):
            paginate(self.items, 0, 10)

    def test_exact_multiple_has_no_empty_page(self):
        items = list(range(20))
        page = paginate(items, 2, 10)
        self.assertEqual(page.items, list(range(10, 20)))
        self.assertEqual(page.total_pages, 2)
        self.assertFalse(page.has_next)
        with self.assertRaises(ValueError):
            paginate(items, 3, 10)


if __name__ == "__main__":
    unittest.main()
