"""Build the notebook as one offline web page: ``make html`` → site/index.html (our addition).

The page is the committed notebook with its stored outputs, converted by nbconvert with our
template (web/article/). Formulas are typeset here, at build time, by KaTeX (npm, pinned in
web/package.json, fetched into the git-ignored web/node_modules), so the page needs no script
for them; KaTeX's fonts, the figures and the styles are embedded. The page loads nothing.
"""
from __future__ import annotations

import argparse
import base64
import copy
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote

WEB = Path(__file__).resolve().parent
ROOT = WEB.parent
KATEX = WEB / "node_modules" / "katex"
SLOT = re.compile(r'<span data-math-slot="(\d+)"></span>')
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class MissingTool(Exception):
    """A program the build needs is not installed or could not be fetched; the message says which, in one line."""


def pinned_katex_version() -> str:
    """The KaTeX version web/package.json pins."""
    return json.loads((WEB / "package.json").read_text())["dependencies"]["katex"]


def ensure_katex() -> None:
    """Install the pinned KaTeX into web/node_modules with ``npm ci`` unless it is already there."""
    if shutil.which("node") is None:
        raise MissingTool("make html needs Node.js (node and npm) to typeset the formulas with KaTeX; "
                          "install it (e.g. apt-get install nodejs npm) and run make html again")
    package = KATEX / "package.json"
    if package.is_file() and json.loads(package.read_text())["version"] == pinned_katex_version():
        return
    if shutil.which("npm") is None:
        raise MissingTool("make html needs npm to fetch the KaTeX math renderer once; "
                          "install it (e.g. apt-get install npm) and run make html again")
    fetched = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=WEB)
    if fetched.returncode != 0:
        raise MissingTool(f"make html could not fetch KaTeX {pinned_katex_version()} with npm ci in web/ "
                          "(is the npm registry reachable?)")


def typeset(formulas: list[dict]) -> list[str]:
    """KaTeX's HTML for each ``{"tex", "display"}``, in one run of web/render_math.js."""
    result = subprocess.run(["node", str(WEB / "render_math.js")], input=json.dumps(formulas),
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"KaTeX could not typeset a formula: {result.stderr.strip()}")
    return json.loads(result.stdout)


def katex_css() -> str:
    """KaTeX's style sheet with its WOFF2 fonts embedded as data URIs (the other formats dropped)."""
    css = (KATEX / "dist" / "katex.min.css").read_text()

    def embed(match: re.Match) -> str:
        font = base64.b64encode((KATEX / "dist" / "fonts" / f"{match.group(1)}.woff2").read_bytes()).decode()
        return f'src:url(data:font/woff2;base64,{font}) format("woff2")'

    css = re.sub(r"src:url\(fonts/([\w-]+)\.woff2\)[^;}]*", embed, css)
    if "url(fonts/" in css:
        raise SystemExit("KaTeX's style sheet refers to a font that was not embedded")
    return css


def tidy_stream(text: str) -> str:
    r"""Printed text as a terminal would leave it: colour codes removed, each line after its last ``\r``."""
    lines = []
    for line in ANSI.sub("", text).split("\n"):
        parts = [p for p in line.split("\r") if p.strip()]
        lines.append(parts[-1] if parts else "")
    return "\n".join(lines)


def plain(markdown: str) -> str:
    """Markdown reduced to plain words for alt text: no code ticks, math dollars or emphasis marks."""
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", markdown)
    text = re.sub(r"[`$*_>#]|\\(?=[a-zA-Z])", "", text)
    return re.sub(r"\s+", " ", text).strip()


def figure_alt(code: str, prose: str) -> str:
    """Alt text for a figure a code cell drew: its titles and axis labels, else the prose before it."""
    found = []
    for call, what in (("suptitle", "Plot"), ("set_title", "Plot"), ("set_xlabel", "x axis"),
                       ("set_ylabel", "y axis")):
        for text in re.findall(call + r'\(\s*"([^"{}]+)"', code):
            found.append(f"{what}: " + text.replace("\\n", " "))  # a line break written in the string
    if found:
        return "; ".join(found)
    paragraphs = [p for p in prose.split("\n\n") if p.strip()]
    return "Figure: " + plain(paragraphs[-1] if paragraphs else "output of the code above")


def with_alt_text(nb):
    """A copy of ``nb`` in which every image output carries alt text (its own, the cell's, or derived)."""
    nb = copy.deepcopy(nb)
    prose = ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            prose = cell.source
            continue
        for output in cell.get("outputs", []):
            for mime in ("image/png", "image/jpeg", "image/svg+xml"):
                if mime in output.get("data", {}):
                    meta = output.setdefault("metadata", {}).setdefault(mime, {})
                    meta.setdefault("alt", cell.metadata.get("alt") or figure_alt(cell.source, prose))
    return nb


def make_exporter(formulas: list[dict]):
    """nbconvert's HTML exporter with our template, whose Markdown leaves a numbered slot per formula."""
    from jinja2 import pass_context
    from nbconvert import HTMLExporter
    from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath

    class MathSlots(IPythonRenderer):
        """Markdown renderer that records each formula's TeX and leaves a slot for its typeset form."""

        def _slot(self, tex: str, display: bool) -> str:
            formulas.append({"tex": tex, "display": display})
            return f'<span data-math-slot="{len(formulas) - 1}"></span>'

        def block_math(self, body: str) -> str:
            return self._slot(body, True)

        def inline_math(self, body: str) -> str:
            return self._slot(body, False)

        def latex_environment(self, name: str, body: str) -> str:
            return self._slot(f"\\begin{{{name}}}{body}\\end{{{name}}}", True)

    class ArticleExporter(HTMLExporter):
        """The notebook as an article: web/article/index.html.j2 and the filters it uses."""

        @pass_context
        def markdown2html(self, context, source):
            cell = context.get("cell", {})
            path = context.get("resources", {}).get("metadata", {}).get("path", "")
            renderer = MathSlots(escape=False, attachments=cell.get("attachments", {}), embed_images=True,
                                 path=path, anchor_link_text="¶")
            return MarkdownWithMath(renderer=renderer).render(source)

        def default_filters(self):
            yield from super().default_filters()
            yield ("markdown2html", self.markdown2html)
            yield ("tidy_stream", tidy_stream)
            yield ("svg_data_uri",
                   lambda svg: "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode())

    return ArticleExporter(extra_template_basedirs=[str(WEB)], template_name="article")


def heading_text(tag) -> str:
    """A heading's words without its ¶ anchor link."""
    return "".join(t for t in tag.find_all(string=True) if not t.find_parent(class_="anchor-link")).strip()


def arrange(html: str) -> str:
    """The article's structure: title block, contents, paper quotations set apart, unique heading ids."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    main = soup.find("main")
    # The paper's words: one or more block quotes and the "— §…" line after them become one figure.
    # (A block quote always quotes the paper here; the line names where, "— Abstract" included.)
    for quote in main.find_all("blockquote"):
        if quote.find_parent("figure") is not None:
            continue
        group = [quote]
        nxt = quote.find_next_sibling()
        while nxt is not None and nxt.name == "blockquote":
            group.append(nxt)
            nxt = nxt.find_next_sibling()
        figure = soup.new_tag("figure", attrs={"class": "paper-quote"})
        quote.insert_before(figure)
        for q in group:
            figure.append(q.extract())
        if nxt is not None and nxt.name == "p" and nxt.get_text().startswith("— "):
            caption = soup.new_tag("figcaption")
            for child in list(nxt.contents):
                caption.append(child.extract())
            nxt.decompose()
            figure.append(caption)
    # Unique ids for headings; the first heading and the paragraph under it become the title block.
    seen: set = set()
    headings = main.find_all(["h1", "h2", "h3"])
    for h in headings:
        base, n = unquote(h.get("id") or "section"), 1
        h["id"] = base
        while h.get("id") in seen or not h.get("id"):
            n += 1
            h["id"] = f"{base}-{n}"
        seen.add(h["id"])
        for a in h.find_all("a", class_="anchor-link"):
            a["href"] = "#" + h["id"]
    title = headings[0]
    header = soup.new_tag("header", attrs={"class": "title-block"})
    subtitle = title.find_next_sibling("p")
    soup.find("div", class_="layout").insert_before(header)
    header.append(title.extract())
    if subtitle is not None:
        header.append(subtitle.extract())
    # Contents: the Parts (h1) and the sections under them; subsections only when they are the paper's.
    details = soup.new_tag("details")
    summary = soup.new_tag("summary")
    summary.string = "Contents"
    details.append(summary)
    top = soup.new_tag("ol")
    details.append(top)
    lists = {0: top}  # heading level → the list that holds the entries below it
    for h in headings[1:]:
        level = int(h.name[1])
        if level == 3 and not heading_text(h).startswith("§"):
            continue
        parent = lists[max(k for k in lists if k < level)]
        li = soup.new_tag("li", attrs={"class": "toc-part" if level == 1 else f"toc-{level}"})
        link = soup.new_tag("a", href="#" + h["id"])
        link.string = heading_text(h)
        li.append(link)
        parent.append(li)
        sub = soup.new_tag("ol")
        li.append(sub)
        lists = {k: v for k, v in lists.items() if k < level}
        lists[level] = sub
    for empty in details.find_all("ol"):
        if not empty.contents:
            empty.decompose()
    soup.find("nav", class_="toc").append(details)
    return str(soup)


def build(notebook: Path, out: Path) -> dict:
    """Write the page for ``notebook`` to ``out``; returns its size, formula count and build time."""
    import nbformat
    from pygments.formatters import HtmlFormatter

    start = time.perf_counter()
    ensure_katex()
    nb = with_alt_text(nbformat.read(notebook, as_version=4))
    formulas: list[dict] = []
    exporter = make_exporter(formulas)
    title = next((line[2:].strip() for c in nb.cells if c.cell_type == "markdown"
                  for line in c.source.splitlines() if line.startswith("# ")), notebook.stem)
    css = "\n".join([(WEB / "page.css").read_text(), HtmlFormatter(style="friendly").get_style_defs(".highlight"),
                     katex_css()])
    resources = {"metadata": {"path": str(notebook.parent), "name": notebook.stem},
                 "page_title": title, "page_css": css, "page_js": (WEB / "page.js").read_text()}
    html, _ = exporter.from_notebook_node(nb, resources=resources)
    typeset_html = typeset(formulas)
    html = SLOT.sub(lambda m: typeset_html[int(m.group(1))], html)
    html = arrange(html)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return {"bytes": out.stat().st_size, "formulas": len(formulas), "seconds": time.perf_counter() - start}


def main(argv=None) -> int:
    """Command line of ``make html``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", type=Path, default=ROOT / "annotated_transformer.ipynb")
    parser.add_argument("--out", type=Path, default=ROOT / "site" / "index.html")
    args = parser.parse_args(argv)
    try:
        stats = build(args.notebook, args.out)
    except MissingTool as err:
        print(err, file=sys.stderr)
        return 2
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}: "
          f"{stats['bytes'] / 1e6:.1f} MB, {stats['formulas']} formulas, {stats['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
