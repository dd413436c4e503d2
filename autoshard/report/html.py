"""A plan's report as one self-contained HTML page (jax-free).

Takes a :class:`~autoshard.report.digest.PlanDigest`, its
:class:`~autoshard.report.pictures.Pictures` and, optionally, a simulated step; returns
(or writes) one HTML document: the sections of :mod:`autoshard.report.text`, then the
pictures inlined as ``data:image/png;base64`` and the three exports. No script, no
stylesheet or font from elsewhere: the page opens with no network.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping

from autoshard.report.digest import PlanDigest
from autoshard.report.pictures import Pictures
from autoshard.report.text import sections

STYLE = """
body { font-family: sans-serif; max-width: 70em; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }
td.num { text-align: right; }
code, pre { background: #f4f4f4; }
pre { padding: 0.6em; overflow-x: auto; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
"""

CAPTIONS = {
    "mesh": "The device mesh, coloured by pipeline stage.",
    "timeline": "The pipeline timeline (1F1B): forward, backward, update; idle is the bubble.",
    "memory": "Memory per device of each layer's weights, gradients and optimizer state.",
    "tensor": "Which device holds which block of {tensor}.",
}


def render_html(d: PlanDigest, pictures: Pictures, simulated: Mapping | None = None) -> str:
    """The page of a one-mesh plan (module docstring)."""
    from autoshard.report.export import EXPORTERS

    title = f"autoshard plan {d.plan.name} for {d.plan_file.model or 'your function'}"
    captions = {k: v.format(tensor=pictures.tensor_path) for k, v in CAPTIONS.items()}
    exports = {}
    for target, exporter in EXPORTERS.items():
        try:
            exports[target] = exporter(d)
        except ValueError as err:
            exports[target] = str(err)
    return render_page(title, sections(d, simulated), pictures.png, captions, exports)


def render_page(title: str, secs, png: Mapping[str, bytes], captions, exports) -> str:
    """One page: ``secs`` (:class:`~autoshard.report.text.Section`), the PNGs inlined,
    and ``exports`` (target -> :class:`~autoshard.report.export.Export`, or the reason
    there is none)."""
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
    ]
    for s in secs:
        parts.append(f"<h2>{esc(s.title)}</h2>")
        parts += [f"<p>{esc(line)}</p>" for line in s.lines]
        if s.rows:
            parts.append("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in s.header) + "</tr>")
            for row in s.rows:
                cells = "".join(
                    f'<td class="num">{esc(c)}</td>' if "bytes" in h else f"<td>{esc(c)}</td>"
                    for h, c in zip(s.header, row)
                )
                parts.append(f"<tr>{cells}</tr>")
            parts.append("</table>")
    parts.append("<h2>Pictures</h2>")
    for name, data in png.items():
        b64 = base64.b64encode(data).decode("ascii")
        parts.append(
            f'<figure><img alt="{esc(name)}" src="data:image/png;base64,{b64}">'
            f"<figcaption>{esc(captions.get(name, name))}</figcaption></figure>"
        )
    parts.append("<h2>Exports</h2>")
    for target, out in exports.items():
        if isinstance(out, str):
            parts.append(f"<h3>{esc(target)}</h3><p>no export: {esc(out)}</p>")
            continue
        parts.append(f"<h3>{esc(target)}</h3><pre>{esc(out.text)}</pre>")
        parts += [f"<p>note: {esc(n)}</p>" for n in out.notes]
        if out.exact:
            parts.append("<p>every tensor laid out as the plan lays it out</p>")
        else:
            parts.append(
                f"<p>{len(out.differences)} tensor(s) or stage(s) laid out otherwise:</p>"
                "<table><tr><th>tensor or stage</th><th>plan</th><th>export</th></tr>"
            )
            for diff in out.differences:
                parts.append(
                    f"<tr><td>{esc(diff.path)}</td><td>{esc(diff.plan_spec)}</td>"
                    f"<td>{esc(diff.export_spec)}</td></tr>"
                )
            parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_page(text: str, path) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as err:
        raise ValueError(f"cannot write the HTML page to {str(path)!r}: {err.strerror}") from None


def write_html(d: PlanDigest, pictures: Pictures, path, simulated: Mapping | None = None) -> None:
    write_page(render_html(d, pictures, simulated), path)
