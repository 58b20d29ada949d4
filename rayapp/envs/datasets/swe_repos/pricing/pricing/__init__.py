from pricing.checkout import MIN_ORDER_FOR_DISCOUNT, discount_amount, order_total

__all__ = ["MIN_ORDER_FOR_DISCOUNT", "discount_amount", "order_total"]
