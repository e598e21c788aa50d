"""Minimal static HTML: a page, headings, tables and linked PNGs (no scripts, no assets)."""

from html import escape

STYLE = """body{font-family:sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 8px;
text-align:right}th{background:#f3f3f3}img{max-width:100%;display:block;margin:1em 0}
.flag{color:#b00}.log td{text-align:left}.log td:nth-child(-n+3){white-space:nowrap}
.t1 td:last-child,.t2 td:nth-last-child(-n+2){text-align:left}summary{cursor:pointer;margin:1em 0}"""


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return escape(str(value))


def table(headers: list[str], rows: list[list], cls: str = "") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{fmt(v)}</td>" for v in row) + "</tr>" for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><tr>{head}</tr>{body}</table>"


def image(src: str, alt: str) -> str:
    return f'<a href="{escape(src)}"><img src="{escape(src)}" alt="{escape(alt)}"></a>'


def details(summary: str, inner: str, open_: bool = False) -> str:
    """A folded block (no script): `summary` shown, `inner` HTML on a click (or open)."""
    attr = " open" if open_ else ""
    return f"<details{attr}><summary>{escape(summary)}</summary>{inner}</details>"


def heading(text: str, level: int = 2) -> str:
    return f"<h{level}>{escape(text)}</h{level}>"


def paragraph(text: str, cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<p{attr}>{escape(text)}</p>"


def page(title: str, parts: list[str]) -> str:
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>"
        + "\n".join(parts)
        + "</body></html>\n"
    )
