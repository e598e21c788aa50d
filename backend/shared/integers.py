"""Integer helpers every layer uses (no imports): ceil division, rounding up to a multiple."""


def ceil_div(n: int, d: int) -> int:
    """ceil(n / d) in integers (no float rounding)."""
    return -(-n // d)


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return ceil_div(n, multiple) * multiple
