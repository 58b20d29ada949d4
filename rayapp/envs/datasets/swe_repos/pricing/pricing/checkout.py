"""What a customer pays at checkout."""

MIN_ORDER_FOR_DISCOUNT = 50.00


def discount_amount(subtotal: float, percent: float) -> float:
    """``percent`` of ``subtotal``, rounded to cents."""
    if not 0 <= percent <= 100:
        raise ValueError(f"percent must be between 0 and 100, got {percent}")
    return round(subtotal * percent / 100, 2)


def order_total(subtotal: float, shipping: float = 0.0, percent: float = 0.0) -> float:
    """The goods, less the discount when the order qualifies for one, plus shipping."""
    qualifies = subtotal >= MIN_ORDER_FOR_DISCOUNT
    discount = discount_amount(subtotal, percent)
    return round(subtotal - discount if qualifies else subtotal + shipping, 2)
