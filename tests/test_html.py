"""The notebook as a web page (make html), checked in a real browser.

Headless Chromium is the system's (Debian's ``chromium``), driven by playwright; no
browser is downloaded, and every request other than file:// is refused and noted. The
page is built once from the committed notebook and its stored outputs, and once from a
small fixture notebook for what the real one may not have yet (the attention maps to
explore, a skippable section with a heading inside). Screenshots for a person are
written to runs/html/; the measured numbers are printed (pytest -s shows them).
"""

import base64
import importlib.util
import json
import random
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "annotated_transformer.ipynb"
SHOTS = ROOT / "runs" / "html"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KATEX_INSTALLED = (ROOT / "web" / "node_modules" / "katex" / "package.json").is_file()
# Headless Chromium as root, offline and quiet: no sandbox (root), no GPU, and none of
# the background requests (updates, sync, first-run pages) that would reach the network.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-default-apps",
    "--disable-extensions", "--no-default-browser-check", "--metrics-recording-only",
]  # fmt: skip
WIDTHS = (1280, 390)
# The screens the page is checked on: a laptop, 1280×800, and a phone, 390×844; any
# other width gets the laptop's height. HEIGHT, the smaller, is one "screen".
SCREENS = {1280: 800, 390: 844}
HEIGHT = 800
MENTION = re.compile(r"§\s?\d+(?:\.\d+)*|\bEq\.\s?\d+|\b(?:Figure|Table|Part)\s\d+")

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="Chromium is not installed (Debian: apt-get install chromium)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="playwright is not installed (make install)",
    ),
    pytest.mark.skipif(
        shutil.which("node") is None
        or (shutil.which("npm") is None and not KATEX_INSTALLED),
        reason="Node.js and npm are needed to fetch and run KaTeX "
        "(apt-get install nodejs npm)",
    ),
]


build = load_script(ROOT / "web" / "build.py", "web_page_build")
paper_figures = load_script(ROOT / "figures" / "draw_figures.py", "paper_figures")


def markdown_formulas(notebook: Path) -> int:
    """Formulas in the notebook's Markdown, from its text: ``$$…$$`` and ``$…$``."""
    count = 0
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        text = re.sub(
            r"^ {0,3}> ?", "", cell.source, flags=re.M
        )  # block quotes: inside
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # fenced code
        text = re.sub(r"(`+)(?!`).+?(?<!`)\1(?!`)", "", text, flags=re.S)  # code spans
        display = re.findall(r"\$\$.+?\$\$", text, flags=re.S)
        text = re.sub(r"\$\$.+?\$\$", "", text, flags=re.S)
        inline = re.findall(r"(?<!\\)\$[^$]+?(?<!\\)\$", text, flags=re.S)
        count += len(display) + len(inline)
    return count


def attributions(notebook: Path) -> int:
    """The paper's quotations: each ends with one "— §…" line under its block quotes."""
    cells = nbformat.read(notebook, as_version=4).cells
    return sum(
        len(re.findall(r"^>.*\n\s*\n— ", c.source, flags=re.M))
        for c in cells
        if c.cell_type == "markdown"
    )


def has_attention_maps(notebook: Path) -> bool:
    """Whether a cell output carries the attention maps the page can explore."""
    return any(
        build.ATTENTION_MIME in o.get("data", {})
        for c in nbformat.read(notebook, as_version=4).cells
        if c.cell_type == "code"
        for o in c.outputs
    )


def softmax_rows(n_q: int, n_k: int, rng: random.Random, causal: bool = False) -> list:
    """``n_q`` rows of ``n_k`` weights summing to 1 (3 decimals), as notebooks write."""
    rows = []
    for i in range(n_q):
        raw = [rng.random() ** 4 if not causal or j <= i else 0.0 for j in range(n_k)]
        rows.append([round(w / sum(raw), 3) for w in raw])
    return rows


def fixture_notebook(path: Path) -> Path:
    """A small notebook of what the page is built from, the attention maps included."""
    rng = random.Random(0)
    src = ["▁Ein", "▁Hund", "▁läuft", "▁schnell", ".", "</s>"]
    tgt = ["<s>", "▁A", "▁dog", "▁runs", "▁fast", "."]
    blob = {
        "sentence": {"src": src, "tgt": tgt, "tgt_out": tgt[1:] + ["</s>"]},
        "maps": {
            "encoder": [[softmax_rows(6, 6, rng) for _ in range(4)] for _ in range(2)],
            "decoder": [
                [softmax_rows(6, 6, rng, True) for _ in range(4)] for _ in range(2)
            ],
            "cross": [[softmax_rows(6, 6, rng) for _ in range(4)] for _ in range(2)],
        },
    }
    new = nbformat.v4
    cells = [
        new.new_markdown_cell(
            "# A fixture\n\nA notebook for the page's tests.\n\n"
            "On a first reading, skip to Part 2; the aside is optional."
        ),
        new.new_markdown_cell(
            "# Part 1 — The model\n\n## §3.2.1 Scaled Dot-Product Attention\n\n"
            "> The weights, $x$.\n\n— §3.2.1, Eq. 1\n\n"
            "Eq. 1 is §3.2.1's; §9.9 and Table 7 are not on this page; see "
            "[the detail](#part-1-inner-detail)."
        ),
        new.new_code_cell(
            'print("it\'s")',
            outputs=[
                new.new_output(
                    "stream", name="stdout", text="it &apos;s &quot;ok&quot;\n"
                )
            ],
        ),
        new.new_markdown_cell(
            "## Aside: a detour\n\nA detour a first reading may skip.\n\n"
            "### Inner detail\n\nDeep text about label smoothing."
        ),
        new.new_markdown_cell(
            "# Part 2 — Real runs\n\n### What the model attends to\n\n"
            "<!-- alt: never used: this cell shows no image -->\nAs §3.2.1 says."
        ),
        new.new_code_cell(
            "show(maps)",
            outputs=[
                new.new_output(
                    "display_data",
                    data={build.ATTENTION_MIME: blob, "text/plain": "<attention maps>"},
                )
            ],
        ),
        new.new_markdown_cell("## Table 3 at our scale\n\nThe rows, as a table."),
        new.new_code_cell(
            "if IN_NOTEBOOK:\n    display(Markdown(table))",
            outputs=[
                new.new_output(
                    "display_data",
                    data={
                        "text/markdown": "| row | BLEU | paper BLEU |\n|---|--:|--:|\n"
                        "| base | 20.2 | 25.8 |\n| A-h1 | 19.8 | 24.9 |\n"
                        "<script>window.ran = 1</script>",
                        "text/plain": "<IPython.core.display.Markdown object>",
                    },
                ),
                new.new_output(
                    "display_data",
                    data={
                        "text/html": '<table onclick="window.ran = 2"><tr><th>a</th>'
                        '</tr><tr><td><img src="https://example.org/x.png">1</td>'
                        "</tr></table><script>window.ran = 3</script>",
                        "text/plain": "a table",
                    },
                ),
            ],
        ),
        new.new_code_cell('if __name__ == "__main__":\n    sys.exit(main())'),
    ]
    nbformat.write(new.new_notebook(cells=cells), path)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The real notebook's page, built once: its path and the build's numbers."""
    out = tmp_path_factory.mktemp("site") / "index.html"
    try:
        stats = build.build(NB, out)
    except build.MissingTool as err:  # no npm, or KaTeX not fetched yet and no network
        pytest.skip(str(err))
    print(
        f"\npage: {stats['bytes']:,} bytes, {stats['formulas']} formulas typeset, "
        f"built in {stats['seconds']:.1f} s"
    )
    return {"path": out, **stats}


@pytest.fixture(scope="module")
def site(built) -> Path:
    return built["path"]


@pytest.fixture(scope="module")
def fixture_site(tmp_path_factory, site) -> Path:
    """The fixture notebook's page (after the real one, so KaTeX is there)."""
    where = tmp_path_factory.mktemp("fixture")
    out = where / "index.html"
    build.build(fixture_notebook(where / "fixture.ipynb"), out)
    return out


@pytest.fixture(scope="module")
def explorer_site(site, fixture_site) -> Path:
    """A page with the attention maps to explore: the real one once it has them."""
    return site if has_attention_maps(NB) else fixture_site


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Visit:
    """One page load at a width, noting console errors and every non-local request."""

    def __init__(self, browser, site: Path, width: int, **options):
        self.context = browser.new_context(
            viewport={"width": width, "height": SCREENS.get(width, HEIGHT)}, **options
        )
        self.left_file, self.errors = [], []

        def block(route):
            self.left_file.append(route.request.url)
            route.abort()

        # http, https, ws, …: refused and noted
        self.context.route(re.compile(r"^(?!file:|data:)"), block)
        self.page = self.context.new_page()
        self.requests = []  # every address the page asked for, file:// included
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on(
            "console",
            lambda m: self.errors.append(m.text) if m.type == "error" else None,
        )
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(site.as_uri(), wait_until="load")

    def close(self):
        self.context.close()


@pytest.fixture(scope="module")
def wide(browser, site):
    visit = Visit(browser, site, 1280)
    yield visit
    visit.close()


@pytest.fixture(scope="module")
def fixture_wide(browser, fixture_site):
    visit = Visit(browser, fixture_site, 1280)
    yield visit
    visit.close()


@pytest.fixture
def fresh(browser, site):
    """A visit of its own for a test that changes the page, at the width it asks."""
    visits = []

    def visit(width: int, page_site: Path = site, **options) -> Visit:
        visits.append(Visit(browser, page_site, width, **options))
        return visits[-1]

    yield visit
    for v in visits:
        v.close()


OPEN_ALL = "document.querySelectorAll('details').forEach(d => { d.open = true; })"


# --- Hostile outputs: nothing runs, nothing is loaded ---------------------------------

# Cell outputs that try to run script or load from elsewhere: those the page was once
# fooled by, and mutation-XSS cases from the published lists (parser differentials:
# foreign content, raw-text elements, comments and CDATA). Each script sets
# window.pwned; each address is on example.org, which the test's network refuses.
TINY_PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVO"
    "RK5CYII="
)
HOSTILE_HTML = [
    "<![CDATA[><img src=x onerror=window.pwned=1>]]>",
    '<svg><a><animate attributeName="href" values="javascript:window.pwned=2"/>'
    '<text x="20" y="20">animate</text></a></svg>',
    '<svg><a><set attributeName="href" to="javascript:window.pwned=3"/>'
    '<text x="20" y="20">set</text></a></svg>',
    f'<img alt="t" src="data:image/png;base64,{TINY_PNG}" '
    'srcset="https://example.org/srcset.png 2x">',
    '<svg><image href="https://example.org/image.png"/></svg>',
    '<svg><filter id="f"><feImage href="https://example.org/feimage.png"/></filter>'
    '<rect filter="url(#f)" width="9" height="9"/></svg>',
    '<svg><use href="https://example.org/use.svg#x"/></svg>',
    '<table background="https://example.org/table.png"><tr><td>t</td></tr></table>',
    '<body background="https://example.org/body.png"><p>a nested body</p></body>',
    '<a href="#title" ping="https://example.org/ping">ping</a>',
    '<svg><rect fill="url(https://example.org/fill.svg#g)" width="9" height="9"/>'
    "</svg>",
    '<math><maction actiontype="statusline" href="https://example.org/maction">m'
    "</maction></math>",
    '<noscript><p title="</noscript><img src=x onerror=window.pwned=4>"></noscript>',
    '<svg></p><style><a id="</style><img src=1 onerror=window.pwned=5>"></style></svg>',
    '<math><mtext><table><mglyph><style><!--</style><img title="--&gt;&lt;/mglyph&gt;'
    '&lt;img&Tab;src=1&Tab;onerror=window.pwned=6&gt;"></table></mtext></math>',
    "<form><math><mtext></form><form><mglyph><style></math>"
    "<img src onerror=window.pwned=7>",
    "<svg><style><img src=x onerror=window.pwned=8></style></svg>",
    '<a href="jav&#x09;ascript:window.pwned=9">tab</a>'
    '<a href="  JaVaScRiPt:window.pwned=10">case</a>'
    '<a href="data:text/html,<script>window.pwned=11</script>">data</a>',
    '<iframe srcdoc="<script>parent.pwned=12</script>"></iframe>'
    '<object data="data:text/html,<script>parent.pwned=13</script>"></object>',
    '<base href="https://example.org/"><meta http-equiv="refresh" '
    'content="0;url=https://example.org/refresh">',
    '<link rel="stylesheet" href="https://example.org/link.css">'
    "<style>@import url(https://example.org/import.css);</style>"
    '<div style="background:url(https://example.org/style.png)">styled</div>',
    '<video poster="https://example.org/poster.png"></video>'
    '<input type="image" src="https://example.org/input.png">'
    '<details open ontoggle="window.pwned=14"><summary>s</summary></details>',
    "<img src=`x` onerror=window.pwned=15><script>window.pwned=16</script>",
    '<img src="data:image/svg+xml,<svg onload=window.pwned=17>">'
    '<svg onload="window.pwned=18"><script>window.pwned=19</script></svg>',
    '<a href="https://example.org/ok">a link out</a>',
    "<xmp><img src=x onerror=window.pwned=20></xmp>"
    "<noembed><img src=x onerror=window.pwned=21></noembed>",
    "<template><img src=x onerror=window.pwned=22></template>"
    '<textarea></textarea><img src=x onerror="window.pwned=23">',
    "<plaintext><img src=x onerror=window.pwned=24>",  # the rest as text
]
HOSTILE_MARKDOWN = (
    "| a | b |\n|---|---|\n| [x](javascript:window.pwned=30) | "
    "<img src=x onerror=window.pwned=31> |\n\n"
    "![p](https://example.org/markdown.png) <!--<script>window.pwned=32</script>"
)


def hostile_notebook(path: Path) -> Path:
    """A copy of the committed notebook with hostile outputs after its first cells:
    HTML, Markdown, a raw HTML cell, JavaScript, a printed ``</pre><script>``, an
    error, alt text and attention tokens that try to end their element, and
    ``<!--<script>`` in a code comment and a heading."""
    nb = nbformat.read(NB, as_version=4)
    new = nbformat.v4
    rng = random.Random(1)
    tokens = ["<!--<script>", "</script><script>window.pwned=40</script>", "x"]
    blob = {
        "sentence": {"src": tokens, "tgt": tokens, "tgt_out": tokens},
        "maps": {"encoder": [[softmax_rows(3, 3, rng)]]},
        "title": "</script><script>window.pwned=41</script>",
    }
    cells = [
        new.new_markdown_cell(
            "## Hostile outputs \\<!--\\<script>\n\nThe cells below. "
            "<script>window.pwned=42</script>"  # the prose's own: the policy stops it
        ),
        new.new_code_cell(
            "# a comment: <!--<script> and </script>\nshow()",
            outputs=[
                *(
                    new.new_output("display_data", data={"text/html": h})
                    for h in HOSTILE_HTML
                ),
                new.new_output(
                    "display_data", data={"text/markdown": HOSTILE_MARKDOWN}
                ),
                new.new_output(
                    "display_data", data={"application/javascript": "window.pwned = 50"}
                ),
                new.new_output(
                    "stream", name="stdout", text="</pre><script>window.pwned=51"
                ),
                new.new_output(
                    "error",
                    ename="E",
                    evalue="",
                    traceback=["<img src=x onerror=window.pwned=52>"],
                ),
                new.new_output(
                    "display_data",
                    data={"image/png": TINY_PNG},
                    metadata={
                        "image/png": {"alt": '"><img src=x onerror=window.pwned=53>'}
                    },
                ),
                new.new_output(
                    "display_data", data={build.ATTENTION_MIME: blob, "text/plain": "m"}
                ),
            ],
        ),
        new.new_raw_cell(
            "<img src=x onerror=window.pwned=60><script>window.pwned=61</script>",
            metadata={"raw_mimetype": "text/html"},
        ),
    ]
    nb.cells[2:2] = cells
    nbformat.write(nb, path)
    return path


def hostile_results(where: Path) -> Path:
    """A copy of results/ whose runs' text fields carry Markdown links and HTML, one
    BLEU a NaN, and Table 3's file torn in half."""
    results = where / "results"
    shutil.copytree(ROOT / "results", results)
    run = json.loads((results / build.HEADLINE).read_text())
    run["cpu"] = "[AMD](javascript:window.pwned=70) <img src=x onerror=window.pwned=71>"
    run["bleu_kind"] = "<script>window.pwned=72</script>"
    (results / build.HEADLINE).write_text(json.dumps(run))
    sample = (results / build.SAMPLE).read_text()
    sample = re.sub(r'"bleu": [0-9.]+', '"bleu": NaN', sample, count=1)
    (results / build.SAMPLE).write_text(sample)
    table3 = (results / build.TABLE3).read_text()
    (results / build.TABLE3).write_text(table3[: len(table3) // 2])
    return results


@pytest.fixture(scope="module")
def hostile_site(tmp_path_factory, site) -> Path:
    """The page of the hostile notebook, results and CITATION.cff (after the real
    page, so KaTeX is there)."""
    where = tmp_path_factory.mktemp("hostile")
    cff = where / "CITATION.cff"
    cff.write_text(
        (ROOT / "CITATION.cff").read_text()
        + 'repository-code: "javascript:window.pwned=80//https://github.com/o/n"\n'
    )
    out = where / "index.html"
    build.build(
        hostile_notebook(where / "hostile.ipynb"), out, hostile_results(where), cff
    )
    return out


CSP_PARTS = ("default-src 'none'", "img-src data:", "font-src data:", "script-src")


@pytest.mark.parametrize("width", WIDTHS)
def test_hostile_outputs_run_no_script_and_load_nothing(fresh, hostile_site, width):
    visit = fresh(width, hostile_site)
    page = visit.page
    page.wait_for_timeout(300)
    # every link the outputs kept, clicked (none leads out but the https:// one)
    for link in page.locator("main .output a:not([href^='https:'])").all():
        link.click()
    page.wait_for_timeout(300)
    state = page.evaluate("""(() => ({
        pwned: window.pwned === undefined ? null : window.pwned,
        csp: [...document.querySelectorAll('meta[http-equiv]')]
            .filter(m => m.httpEquiv.toLowerCase() === 'content-security-policy')
            .map(m => m.content),
        pageJs: !document.querySelector('.toolbar').hidden
            && !document.querySelector('form.search').hidden,
        explorer: !document.querySelector('.ae-controls').hidden,
        risky: [...document.querySelectorAll('main *')].flatMap(e =>
            [...e.attributes].filter(a => /^on|^(srcset|ping|background|poster)$/i
                .test(a.name) || /javascript:|data:text|example[.]org[/](?!ok)/i
                .test(a.value)).map(a => e.tagName + ' ' + a.name)),
        foreign: [...document.querySelectorAll(
            'main .output :is(svg, math, iframe, object, embed, base, meta, ' +
            'link, style, video, input, form, template, noscript)')]
            .filter(e => !e.closest('.attention-explorer'))
            .map(e => e.tagName),
        scripts: [...document.querySelectorAll('script')]
            .filter(s => !/json/.test(s.type)).length,
        after: document.querySelectorAll('main h1').length,
        findings: document.querySelector('aside.findings').textContent,
        repository: [...document.querySelectorAll('.title-links a')]
            .map(a => a.getAttribute('href'))}))()""")
    assert state["pwned"] is None, state
    assert visit.left_file == [], visit.left_file  # nothing asked for from outside
    assert all(u.startswith(("file:", "data:")) for u in visit.requests)
    assert len(state["csp"]) == 1 and all(p in state["csp"][0] for p in CSP_PARTS)
    assert state["pageJs"] and state["explorer"], "page.js did not run"
    assert state["risky"] == [] and state["foreign"] == [], state
    assert state["scripts"] == 3  # the page's own two, and the prose's one
    assert state["after"] >= 4, "the page after the hostile cells is missing"
    assert "nan" not in state["findings"].lower()
    for name in (build.SAMPLE, build.TABLE3):  # says what is missing
        assert f"results/{name}" in state["findings"]
    assert "<img src=x onerror" in state["findings"]  # as text, not markup
    assert not any("javascript" in h for h in state["repository"])
    assert [e for e in visit.errors if "Content Security Policy" not in e] == []
    # and were the sanitiser to let one through, the policy stops it
    page.evaluate("""document.querySelector('main').insertAdjacentHTML('beforeend',
        '<img src="https://example.org/late.png" onerror="window.pwned=90">' +
        '<a id="late" href="javascript:window.pwned=91">late</a>')""")
    page.click("#late")
    page.wait_for_timeout(300)
    assert page.evaluate("window.pwned === undefined")
    assert visit.left_file == []


# --- Offline, typeset, readable -------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_page_requests_nothing_beyond_file_and_logs_no_errors(fresh, width):
    visit = fresh(width)
    visit.page.wait_for_timeout(300)  # anything the page would fetch after load
    assert visit.left_file == [], f"requests that left file://: {visit.left_file}"
    assert visit.errors == []


def test_every_formula_is_typeset_and_no_tex_is_left_in_the_text(wide, built):
    page = wide.page
    typeset = page.evaluate("document.querySelectorAll('main .katex').length")
    assert typeset == markdown_formulas(NB) == built["formulas"]
    assert page.evaluate("document.querySelectorAll('.katex-error').length") == 0
    assert (
        page.evaluate("document.querySelectorAll('main .katex math').length") == typeset
    )
    text = page.evaluate("""() => {
        const main = document.querySelector('main').cloneNode(true);
        main.querySelectorAll('.katex, pre, code').forEach(e => e.remove());
        return main.textContent;
    }""")
    leftovers = re.findall(r"\$[^\s]|\\\(|\\\[|\\begin|\\[a-zA-Z]+\{", text)
    assert leftovers == [], leftovers[:10]


def test_every_image_is_decoded_and_has_alt_text(wide):
    images = wide.page.evaluate("""async () => {
        const imgs = [...document.querySelectorAll('img')];
        await Promise.all(imgs.map(i => i.decode()));
        return imgs.map(i => ({w: i.naturalWidth, h: i.naturalHeight,
                               alt: i.alt.trim()}));
    }""")
    stored = 0  # the stored pictures the page shows: the explorer's cell keeps one
    for c in nbformat.read(NB, as_version=4).cells:
        if c.cell_type != "code":
            continue
        n = sum("image/png" in o.get("data", {}) for o in c.outputs)
        explored = any(build.ATTENTION_MIME in o.get("data", {}) for o in c.outputs)
        stored += min(n, 1) if explored else n
    assert len(images) >= stored > 0
    assert all(i["w"] > 0 and i["h"] > 0 for i in images)
    assert all(i["alt"] for i in images), [i for i in images if not i["alt"]]
    assert not [i["alt"] for i in images if "▁" in i["alt"]]
    # each a sentence a screen reader can say: one line, no TeX, a full stop
    said = [
        i["alt"]
        for i in images
        if not re.fullmatch(r"[A-Z][^\n\\$^{}]{10,400}[.]", i["alt"])
        or re.search(r"\s{2,}", i["alt"])
    ]
    assert said == []


def test_the_papers_words_stand_apart_from_our_commentary(wide):
    page = wide.page
    quotes = page.evaluate("""[...document.querySelectorAll('figure.paper-quote')]
        .map(f => ({
            caption: (f.querySelector('figcaption') || {textContent: ''})
                .textContent.trim(),
            background: getComputedStyle(f).backgroundColor,
            font: getComputedStyle(f).fontFamily}))""")
    loose = page.evaluate("""[...document.querySelectorAll('blockquote')]
        .filter(q => !q.closest('figure.paper-quote')).length""")
    prose = page.evaluate("""(() => {
        const p = document.querySelector('main section > p');
        const s = getComputedStyle(p);
        return {background: s.backgroundColor, font: s.fontFamily}; })()""")
    assert len(quotes) == attributions(NB) and loose == 0
    assert all(re.match(r"— (§\d|Abstract)", q["caption"]) for q in quotes), [
        q["caption"] for q in quotes
    ]
    assert all(
        q["background"] != prose["background"] and q["font"] != prose["font"]
        for q in quotes
    )


def test_no_prompts_progress_bars_warnings_or_escaped_text(wide):
    text = wide.page.evaluate("document.querySelector('main').innerText")
    assert not re.search(r"\b(In|Out)\s*\[\s*\d*\s*\]:", text)
    assert not re.search(r"\d+%\|", text), "progress bar"
    assert not re.search(r"\w*Warning:", text)
    outputs = wide.page.evaluate(
        "[...document.querySelectorAll('pre.output')]"
        ".map(p => p.textContent).join('\\n')"
    )
    assert not re.search(r"&(apos|quot|amp|lt|gt|#\d+);", outputs)


def test_text_outputs_are_detokenized(fixture_wide):
    outputs = fixture_wide.page.evaluate(
        "[...document.querySelectorAll('pre.output')].map(p => p.textContent)"
    )
    assert outputs == ['it \'s "ok"\n']


# --- Code fits ------------------------------------------------------------------------


def long_lines(text: str, columns: int = 88) -> bool:
    return any(len(line) > columns for line in text.split("\n"))


@pytest.mark.parametrize("width", (1280, 1920))
def test_no_code_block_scrolls_sideways_on_a_desktop(fresh, width):
    page = fresh(width).page
    page.evaluate(OPEN_ALL)
    blocks = page.evaluate("""[...document.querySelectorAll('main pre')].map(e => ({
        text: e.textContent, over: e.scrollWidth > e.clientWidth + 1,
        code: !!e.closest('.source')}))""")
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    over = [b for b in blocks if b["over"]]
    wider = [b for b in blocks if b["code"] and long_lines(b["text"])]
    print(
        f"\n{width} px: {len(blocks)} code and output blocks, {len(over)} scroll "
        f"sideways; {len(wider)} code blocks have lines over 88 columns"
    )
    # Every block of lines up to 88 columns fits; wider ones as far as the column goes.
    assert [b["text"][:60] for b in over if not long_lines(b["text"])] == []
    assert [b["text"][:60] for b in over if not long_lines(b["text"], 110)] == []


def test_88_columns_of_code_fit_at_1280_px(wide):
    columns = wide.page.evaluate("""() => {
        const pre = document.querySelector('main .source pre');
        const probe = document.createElement('span');
        probe.textContent = '0'.repeat(88);
        pre.appendChild(probe);
        const need = probe.getBoundingClientRect().width;
        probe.remove();
        const s = getComputedStyle(pre);
        return pre.clientWidth - parseFloat(s.paddingLeft)
            - parseFloat(s.paddingRight) - need;
    }""")
    assert columns >= 0


SCROLLS = """[...document.querySelectorAll('main pre')]
    .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent.slice(0, 60))"""


def test_on_a_phone_code_wraps_and_a_switch_unwraps_it(fresh):
    page = fresh(390).page
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    clipped = page.evaluate("""[...document.querySelectorAll(
            'pre, .katex-display, table')]
        .filter(e => e.scrollWidth > e.clientWidth + 1
            && !['auto', 'scroll'].includes(getComputedStyle(e).overflowX)
            && !['auto', 'scroll'].includes(
                getComputedStyle(e.parentElement).overflowX))
        .map(e => e.textContent.slice(0, 60))""")
    assert clipped == []
    wrap = page.locator(".wrap-button")
    assert wrap.is_visible() and wrap.get_attribute("aria-pressed") == "true"
    page.evaluate(OPEN_ALL)
    blocks = page.evaluate("document.querySelectorAll('main pre').length")
    assert page.evaluate(SCROLLS) == [], "a code block scrolls while wrapping is on"
    wrap.click()
    assert wrap.get_attribute("aria-pressed") == "false"
    scrolling = page.evaluate(SCROLLS)
    print(
        f"\n390 px: {blocks} code and output blocks; unwrapped, {len(scrolling)} scroll"
    )
    assert scrolling  # the switch is kept: long lines scroll again
    wrap.click()
    assert page.evaluate(SCROLLS) == []


def text_under_fixed(page) -> list:
    """Article text that an element fixed (or sticky) on the screen covers."""
    return page.evaluate("""(() => {
        const fixed = [...document.querySelectorAll('body *')].filter(e => {
            const s = getComputedStyle(e);
            const r = e.getBoundingClientRect();
            return ['fixed', 'sticky'].includes(s.position) && s.display !== 'none'
                && s.visibility !== 'hidden' && r.width > 0 && r.height > 0
                && r.right > 0 && r.left < innerWidth && r.bottom > 0
                && r.top < innerHeight && !e.closest('main');
        }).map(e => e.getBoundingClientRect());
        const walker = document.createTreeWalker(document.querySelector('main'),
            NodeFilter.SHOW_TEXT);
        const covered = [];
        for (let n = walker.nextNode(); n; n = walker.nextNode()) {
            if (!n.textContent.trim()
                || n.parentElement.closest('.katex-mathml, .visually-hidden'))
                continue;  // for screen readers only: not drawn
            const box = n.parentElement.getBoundingClientRect();
            if (box.bottom < 0 || box.top > innerHeight) continue;
            const range = document.createRange();
            range.selectNodeContents(n);
            // what scrolls sideways shows only the part inside its box
            const scroller = n.parentElement.closest(
                'pre, .katex-display, figure.plot, .ae-map, table, .output.html');
            const clip = scroller ? scroller.getBoundingClientRect()
                : {left: -1e9, right: 1e9};
            for (const r of range.getClientRects()) {
                if (r.width === 0 || r.bottom < 0 || r.top > innerHeight) continue;
                const left = Math.max(r.left, clip.left);
                const right = Math.min(r.right, clip.right);
                if (left < right && fixed.some(f => left < f.right && right > f.left
                        && r.top < f.bottom && r.bottom > f.top))
                    covered.push(n.textContent.trim().slice(0, 40));
            }
        }
        return covered; })()""")


def test_on_a_phone_nothing_fixed_covers_the_article_text(fresh):
    page = fresh(390).page
    height = page.evaluate("document.documentElement.scrollHeight")
    covered = []
    for at in range(0, height, height // 12):
        page.evaluate(f"window.scrollTo(0, {at})")
        page.wait_for_timeout(30)
        covered += text_under_fixed(page)
    assert covered == []


def test_on_a_phone_display_equations_fit_or_show_that_they_scroll(fresh):
    page = fresh(390).page
    page.evaluate(OPEN_ALL)
    page.wait_for_timeout(200)
    shown = page.evaluate("""[...document.querySelectorAll('main .katex-display')]
        .filter(e => e.getBoundingClientRect().width > 0).map(e => ({
            over: e.scrollWidth > e.clientWidth + 1,
            cue: e.classList.contains('scroll-more-right')
                && getComputedStyle(e).maskImage !== 'none'}))""")
    over = [e for e in shown if e["over"]]
    print(f"\n390 px: {len(shown)} display formulas, {len(over)} scroll (with a cue)")
    assert shown and all(e["cue"] for e in over)


def test_on_a_phone_a_tap_outside_the_contents_closes_them(fresh):
    page = fresh(390).page
    button = page.locator(".toc-button")
    button.click()
    page.wait_for_timeout(300)
    assert button.get_attribute("aria-expanded") == "true"
    panel = page.locator("nav.toc").bounding_box()
    page.mouse.click(panel["x"] / 2, 400)  # the article, left of the panel
    assert button.get_attribute("aria-expanded") == "false"
    button.click()
    page.locator("#search-box").click()  # a tap inside keeps them open
    assert button.get_attribute("aria-expanded") == "true"


def test_printing_wraps_code_and_opens_every_collapsed_part(fresh):
    page = fresh(1280).page
    assert page.evaluate("document.querySelectorAll('details:not([open])').length") > 0
    page.evaluate("window.dispatchEvent(new Event('beforeprint'))")
    assert page.evaluate("document.querySelectorAll('details:not([open])').length") == 0
    page.emulate_media(media="print")
    spaces = page.evaluate("""[...new Set([...document.querySelectorAll('main pre')]
        .map(p => getComputedStyle(p).whiteSpace))]""")
    assert spaces == ["pre-wrap"]
    assert (
        page.evaluate("getComputedStyle(document.querySelector('nav.toc')).display")
        == "none"
    )
    page.evaluate("window.dispatchEvent(new Event('afterprint'))")
    assert page.evaluate("document.querySelectorAll('details:not([open])').length") > 0


def test_every_code_block_has_a_copy_button_that_copies_only_the_code(wide):
    page = wide.page
    page.evaluate("""(() => {
        window.copied = [];
        Object.defineProperty(navigator, 'clipboard', {configurable: true, value: {
            writeText: t => { window.copied.push(t); return Promise.resolve(); }}});
    })()""")
    counts = page.evaluate("""(() => {
        const cells = [...document.querySelectorAll('main .source')];
        const other = [...document.querySelectorAll('main pre')].filter(p =>
            !p.closest('.source') && !p.closest('.output'));
        const blocks = cells.concat(other);
        const buttons = blocks.map(b => (b.matches('pre') ? b.parentElement : b)
            .querySelectorAll(':scope > .copy-button').length);
        cells.forEach(c => c.querySelector('.copy-button').click());
        return {cells: cells.length, other: other.length, buttons}; })()""")
    page.wait_for_timeout(100)
    assert counts["cells"] > 0 and counts["buttons"] == [1] * (
        counts["cells"] + counts["other"]
    )
    expected = [
        c.source
        for c in build.prepare(nbformat.read(NB, as_version=4)).cells
        if c.cell_type == "code"
    ]
    assert page.evaluate("window.copied") == expected  # every line, nothing else


@pytest.mark.parametrize("width", WIDTHS)
def test_the_copy_button_covers_no_label_of_a_folded_block(fresh, width):
    page = fresh(width).page
    page.evaluate(OPEN_ALL)  # the sections a reader opens; the folds stay closed
    page.evaluate(
        "document.querySelectorAll('details.code-fold, details.code-rest')"
        ".forEach(d => { d.open = false; })"
    )
    found = page.evaluate("""[...document.querySelectorAll('.has-copy')].flatMap(h => {
        const b = h.querySelector(':scope > .copy-button').getBoundingClientRect();
        return [...h.querySelectorAll('details > summary')].map(s => {
            const range = document.createRange();
            range.selectNodeContents(s);
            const over = [...range.getClientRects()].some(r => r.width > 0
                && r.left < b.right && r.right > b.left
                && r.top < b.bottom && r.bottom > b.top);
            return {label: s.textContent.trim().slice(0, 40), over}; }); })""")
    assert len(found) >= 10
    assert [f["label"] for f in found if f["over"]] == []


def test_markdown_and_html_outputs_show_as_tables_without_scripts(fixture_wide):
    page = fixture_wide.page
    state = page.evaluate("""(() => {
        const tables = [...document.querySelectorAll('main .output table')];
        tables.forEach(t => t.click());
        return {tables: tables.map(t => [...t.querySelectorAll('td, th')]
                    .map(c => [c.textContent, getComputedStyle(c).textAlign])),
                scripts: document.querySelectorAll(
                    'main .output script:not([type="application/json"])').length,
                images: document.querySelectorAll('main .output img').length,
                ran: window.ran || 0,
                folded: [...document.querySelectorAll('details.code-fold')]
                    .map(d => [d.dataset.why, d.open])}; })()""")
    assert len(state["tables"]) == 2
    assert [text for text, _ in state["tables"][1]] == ["a", "1"]
    assert ["20.2", "right"] in state["tables"][0]
    assert state["scripts"] == state["images"] == state["ran"] == 0, state
    assert state["folded"] == [["table", False]]
    assert fixture_wide.left_file == []


@pytest.mark.parametrize("width", WIDTHS)
def test_table_3_is_an_html_table_beside_the_papers_and_its_code_folded(fresh, width):
    page = fresh(width).page
    found = page.evaluate("""(() => {
        const h = [...document.querySelectorAll('main h2')]
            .find(e => e.textContent.startsWith('Table 3'));
        if (!h) return null;
        const tables = [...h.closest('section').querySelectorAll('.output table')];
        return {tables: tables.map(t => ({
                    rows: t.querySelectorAll('tr').length,
                    head: [...t.querySelectorAll('th')].map(c => c.textContent)})),
                folded: [...h.closest('section').querySelectorAll(
                    'details.code-fold[data-why="table"]')].length,
                pre: [...h.closest('section').querySelectorAll('pre.output')]
                    .filter(p => /[|]\\s*paper/.test(p.textContent)).length}; })()""")
    assert found is not None, "no Table 3 section"
    assert found["tables"], (
        "no <table> under 'Table 3': the notebook's stored output has none (re-run it "
        "once results/table3.json's summary has a finished row)"
    )
    table = found["tables"][0]
    assert table["rows"] >= 2 and any("paper" in h.lower() for h in table["head"])
    assert found["folded"] >= 1 and found["pre"] == 0
    assert page.evaluate("document.documentElement.scrollWidth") <= width


TABLE_3 = """(() => {
    const h = [...document.querySelectorAll('main h2')]
        .find(e => e.textContent.startsWith('Table 3'));
    const table = h && [...h.closest('section').querySelectorAll('.output table')]
        .find(t => /paper/i.test(t.querySelector('tr').textContent));
    if (!table) return null;
    table.scrollIntoView();
    const box = (e) => e.getBoundingClientRect();
    const rows = [...table.querySelectorAll('tr')].filter(r => r.querySelector('td'));
    return {
        scroll: [table.scrollWidth, table.clientWidth],
        page: document.documentElement.scrollWidth,
        lineHeight: parseFloat(getComputedStyle(rows[0].querySelector('td'))
            .lineHeight) || 1.3 * parseFloat(getComputedStyle(table).fontSize),
        fontPx: parseFloat(getComputedStyle(rows[0].querySelector('td')).fontSize),
        rows: rows.map(r => ({
            height: box(r).height,
            cells: [...r.querySelectorAll('td')].map(c => ({
                label: c.dataset.label || '', text: c.textContent.trim(),
                shown: getComputedStyle(c).display !== 'none',
                left: box(c).left, right: box(c).right, height: box(c).height,
                lines: (() => { const r = document.createRange();
                    r.selectNodeContents(c);
                    return new Set([...r.getClientRects()]
                        .map(x => Math.round(x.top))).size; })(),
                numeric: /^[-+−]?[0-9.,]+[MkK%]?( ± [0-9.,]+)?$/.test(
                    c.textContent.trim()),
                wraps: getComputedStyle(c).whiteSpace !== 'nowrap',
                labelShown: getComputedStyle(c, '::before').content
                    .includes(c.dataset.label || '~')}))}))};
})()"""


@pytest.mark.parametrize("width", WIDTHS)
def test_table_3_fits_rows_on_one_line_wide_and_as_cards_on_a_phone(fresh, width):
    page = fresh(width).page
    page.wait_for_timeout(300)  # page.js fits the table after load
    table = page.evaluate(TABLE_3)
    assert table is not None, "no Table 3 with the paper's columns"
    assert table["page"] <= width
    assert table["scroll"][0] <= table["scroll"][1] + 1, "Table 3 scrolls sideways"
    assert table["fontPx"] >= 11
    one_line = 1.9 * table["lineHeight"]
    if width >= 1100:  # beside the contents: a number never breaks, and a row is one
        # line unless a cell of long words had to wrap for the table to fit
        for row in table["rows"]:
            assert all(c["lines"] <= 1 for c in row["cells"] if c["numeric"]), row
            if not any(c["wraps"] for c in row["cells"]):
                assert row["height"] <= one_line, row["cells"][0]["text"]
        two = [r["cells"][0]["text"] for r in table["rows"] if r["height"] > one_line]
        print(
            f"\n{width} px: Table 3 {table['scroll'][1]} px wide, "
            f"{len(table['rows']) - len(two)} of {len(table['rows'])} rows on one "
            f"line at {table['fontPx']:.1f} px (two lines: {', '.join(two) or '-'})"
        )
        return
    # a phone: a card per row; its name, Δ, the paper's numbers and the verdict are
    # on screen with their column's name beside them
    for row in table["rows"]:
        name, *rest = row["cells"]
        assert 0 <= name["left"] and name["right"] <= width and name["text"]
        wanted = [
            c for c in rest if re.search(r"Δ|paper|verdict", c["label"]) and c["text"]
        ]
        assert any("Δ" in c["label"] for c in wanted) or name["text"] == "base"
        for cell in wanted:
            assert cell["shown"] and cell["labelShown"], cell
            assert 0 <= cell["left"] and cell["right"] <= width, cell


def test_plumbing_is_folded_and_the_papers_code_is_not(wide):
    folds = wide.page.evaluate("""[...document.querySelectorAll(
        'main details.code-fold')].map(d => [d.dataset.why, d.open,
        d.querySelector('pre').textContent])""")
    why = {w for w, _, _ in folds}
    assert {"example", "notebook", "hosted"} <= why, why
    # the command line's Ctrl-C handler: a fold of its own, or in the set-up cell's
    assert any("signal.signal(" in text for w, _, text in folds if w != "example")
    assert not any(is_open for _, is_open, _ in folds)
    shown = wide.page.evaluate("""[...document.querySelectorAll('main .source pre')]
        .filter(p => !p.closest('details')).map(p => p.textContent).join('\\n')""")
    assert not re.search(r"^if IN_NOTEBOOK:|^@example|signal\.signal", shown, re.M)
    assert re.search(r"^def subsequent_mask\(", shown, re.M)
    assert re.search(r"^class MultiHeadedAttention\(", shown, re.M)


# --- A short path to the results ------------------------------------------------------


def test_the_page_is_short_and_part_4_comes_early(wide):
    screens, part4 = wide.page.evaluate(f"""[
        document.documentElement.scrollHeight / {HEIGHT},
        (document.getElementById('part-4').getBoundingClientRect().top + scrollY)
            / {HEIGHT}]""")
    print(
        f"\nat 1280×{HEIGHT}: {screens:.1f} screens; Part 4 begins at screen "
        f"{part4:.1f}"
    )
    assert screens <= 70
    assert part4 < 55


def test_asides_are_collapsed_and_open_for_a_link_into_them(fresh, fixture_site):
    page = fresh(1280, fixture_site).page
    asides = page.evaluate("""[...document.querySelectorAll('details.skippable')]
        .map(d => ({open: d.open,
            heading: d.querySelector('summary :is(h1, h2, h3)').textContent}))""")
    assert asides and all(not a["open"] and "Aside" in a["heading"] for a in asides)
    page.click('a[href="#part-1-inner-detail"]')
    landed = page.evaluate("""(() => {
        const h = document.getElementById(location.hash.slice(1));
        const r = h.getBoundingClientRect();
        return {open: h.closest('details').open, top: r.top, height: r.height}; })()""")
    assert landed["open"] and landed["height"] > 0 and 0 <= landed["top"] < HEIGHT


def test_on_the_real_page_asides_and_long_code_are_collapsed(wide):
    counts = wide.page.evaluate("""[
        [...document.querySelectorAll('main :is(h1, h2, h3)')]
            .filter(h => /\\bAside\\b/.test(h.textContent)).length,
        [...document.querySelectorAll('main :is(h1, h2, h3)')]
            .filter(h => /\\bAside\\b/.test(h.textContent) && h.closest('summary'))
            .length,
        document.querySelectorAll('details.code-rest:not([open])').length]""")
    assert counts[0] == counts[1]
    assert counts[2] > 0


def test_every_skip_to_is_a_link(fixture_wide, wide):
    for visit in (fixture_wide, wide):
        bare = visit.page.evaluate("""(() => {
            const walker = document.createTreeWalker(document.querySelector('main'),
                NodeFilter.SHOW_TEXT);
            const bare = [];
            for (let n = walker.nextNode(); n; n = walker.nextNode()) {
                const t = n.textContent;
                if (!/skip to\\s*$/i.test(t) && !/skip to \\S/i.test(t)) continue;
                const next = n.nextSibling;
                if (/skip to\\s*$/i.test(t) && next && next.nodeName === 'A') continue;
                if (n.parentElement.closest('a, code, pre')) continue;
                bare.push(n.textContent.slice(-60));
            }
            return bare; })()""")
        assert bare == []


# --- Navigation -----------------------------------------------------------------------


def test_the_contents_mark_and_show_the_section_being_read(fresh):
    page = fresh(1280).page
    page.evaluate("""window.scrollTo(0,
        document.getElementById('part-4').getBoundingClientRect().top
        + scrollY - 10)""")
    page.wait_for_timeout(200)
    state = page.evaluate("""(() => {
        const a = document.querySelector('.toc-list a[aria-current]');
        const part = document.querySelector('.toc-list a[href="#part-4"]');
        const toc = document.querySelector('nav.toc').getBoundingClientRect();
        const r = a.getBoundingClientRect();
        return {href: a.getAttribute('href'), in_part: part.parentElement.contains(a),
                visible: r.top >= toc.top && r.bottom <= toc.bottom,
                marked: a.classList.contains('current')}; })()""")
    assert state["href"] == "#part-4" and state["visible"] and state["marked"], state


def test_on_a_phone_the_contents_stay_in_reach(fresh):
    page = fresh(390).page
    page.evaluate("window.scrollTo(0, document.documentElement.scrollHeight / 2)")
    button = page.locator(".toc-button")
    box = button.bounding_box()
    assert box and 0 <= box["y"] < HEIGHT
    assert button.evaluate("b => getComputedStyle(b.parentElement).position") == "fixed"
    assert (
        not page.locator("nav.toc").is_visible()
        or not page.locator(".toc-list").is_visible()
    )
    button.click()
    assert button.get_attribute("aria-expanded") == "true"
    page.wait_for_timeout(300)  # the panel slides in
    link = page.locator('.toc-list a[href="#part-2"]')
    assert link.is_visible()
    link.click()
    page.wait_for_timeout(300)
    assert button.get_attribute("aria-expanded") == "false"
    top = page.evaluate("document.getElementById('part-2').getBoundingClientRect().top")
    assert 0 <= top < HEIGHT


def test_every_contents_link_lands_on_a_heading(fresh):
    page = fresh(1280).page
    hrefs = page.evaluate(
        "[...document.querySelectorAll('.toc-list a')].map(a => a.getAttribute('href'))"
    )
    headings = page.evaluate("""[...document.querySelectorAll(
        'main h1, main h2, main h3')].map(h => [h.id, h.tagName, h.textContent])""")
    parts_and_sections = [
        i
        for i, tag, text in headings
        if i != "title" and (tag == "H1" or text.startswith("§"))
    ]
    assert parts_and_sections and {"#" + i for i in parts_and_sections} <= set(hrefs)
    for href in hrefs:
        page.click(f'.toc-list a[href="{href}"]')
        landed = page.evaluate("""() => {
            const id = decodeURIComponent(location.hash.slice(1));
            const el = document.getElementById(id);
            return el && {tag: el.tagName, top: el.getBoundingClientRect().top};
        }""")
        assert landed is not None, f"{href} leads nowhere"
        assert landed["tag"] in ("H1", "H2", "H3") and 0 <= landed["top"] < HEIGHT, (
            href,
            landed,
        )


def test_every_internal_link_lands_on_an_existing_id(wide, fixture_wide):
    for visit in (wide, fixture_wide):
        missing = visit.page.evaluate("""[...document.querySelectorAll('a[href^="#"]')]
            .map(a => a.getAttribute('href'))
            .filter(h => !document.getElementById(decodeURIComponent(h.slice(1))))""")
        assert missing == []
        ids = visit.page.evaluate(
            "[...document.querySelectorAll('[id]')].map(e => e.id)"
        )
        assert len(ids) == len(set(ids)), "duplicate ids"


def test_headings_have_short_ascii_ids_and_a_permalink_that_shows_on_focus(fresh):
    page = fresh(1280).page
    headings = page.evaluate("""[...document.querySelectorAll('main :is(h1, h2, h3)')]
        .map(h => [h.id, h.tagName, h.textContent])""")
    for hid, tag, text in headings:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", hid) and len(hid) <= 40, hid
        if tag == "H1" and (m := re.match(r"Part (\d+)", text)):
            assert hid == f"part-{m.group(1)}"
        if m := re.match(r"§(\d+(?:\.\d+)*)", text):
            assert hid == "s" + m.group(1).replace(".", "-")
    link = page.locator("#s3-2-1 .anchor-link")
    assert link.evaluate("a => getComputedStyle(a).opacity") == "0"
    link.focus()
    assert link.evaluate("a => getComputedStyle(a).opacity") == "1"
    assert link.get_attribute("href") == "#s3-2-1"


def test_mentions_in_prose_link_to_what_they_name(wide, fixture_wide):
    for visit in (wide, fixture_wide):
        links = visit.page.evaluate("""[...document.querySelectorAll('main a.xref')]
            .map(a => {
                const t = document.getElementById(a.getAttribute('href').slice(1));
                const caption = t.querySelector('figcaption');
                return [a.textContent, t.tagName,
                        t.matches('h1, h2, h3') ? t.textContent
                        : caption ? caption.textContent : t.getAttribute('alt') || ''];
            })""")
        assert links
        for text, tag, target in links:
            name = text.replace("\u00a0", " ")
            if name.startswith("Eq."):
                assert tag == "FIGURE" and re.search(re.escape(name) + r"\b", target)
            elif name.startswith("Figure"):
                assert target.startswith(name)
            else:
                assert name in target, (name, target)
        unlinked = visit.page.evaluate("""(() => {
            const walker = document.createTreeWalker(document.querySelector('main'),
                NodeFilter.SHOW_TEXT);
            const out = [];
            for (let n = walker.nextNode(); n; n = walker.nextNode()) {
                if (n.parentElement.closest(
                    'a, code, pre, h1, h2, h3, figcaption, summary, .katex, .output, '
                    + 'svg'))
                    continue;
                out.push(n.textContent);
            }
            return out; })()""")
        targets = build.mention_targets  # what the build can link: the same rules
        assert targets  # (used below through the page's own headings)
        headings = visit.page.evaluate("""[...document.querySelectorAll(
            'main :is(h1, h2, h3)')].map(h => h.textContent)""")
        carried = {
            build.normal_mention(m.group())
            for h in headings
            for m in MENTION.finditer(h)
            if not m.group().startswith("Part") or re.match(r"Part \d", h)
        }
        bare = [
            m.group()
            for text in unlinked
            for m in MENTION.finditer(text)
            if build.normal_mention(m.group()) in carried
        ]
        assert bare == []
    fixture_links = fixture_wide.page.evaluate(
        "[...document.querySelectorAll('main a.xref')].map(a => a.textContent)"
    )
    assert "§9.9" not in fixture_links and "Table\u00a07" not in fixture_links
    assert {"Eq.\u00a01", "§3.2.1", "Part\u00a02"} <= set(fixture_links)


def test_each_part_ends_with_a_link_to_the_next(wide):
    ends = wide.page.evaluate("""[...document.querySelectorAll('section.level-1')]
        .map(s => [s.querySelector('h1').id,
                   [...s.querySelectorAll('.next-part a')]
                       .map(a => a.getAttribute('href'))])""")
    parts = [pid for pid, _ in ends]
    for i, (pid, links) in enumerate(ends):
        assert len(links) == 1, pid
        if i + 1 < len(parts):
            assert links[0] == "#" + parts[i + 1]


@pytest.mark.parametrize("width", WIDTHS)
def test_the_findings_box_under_the_title_says_what_results_holds(fresh, width):
    page = fresh(width).page
    box = page.locator(".title-block aside.findings")
    assert box.is_visible()
    text = " ".join(box.text_content().split())
    run = json.loads((ROOT / "results" / build.HEADLINE).read_text())
    sample = json.loads((ROOT / "results" / build.SAMPLE).read_text())
    for number in (
        f"{run['bleu']:.1f} BLEU",
        f"{run['train_minutes']:.1f} minutes",
        f"{run['steps']:,} updates",
        f"{sample['bleu']:.1f} BLEU",
        f"{sample['steps']:,} updates",
    ):
        assert number in text, number
    table3 = build.table3_state(build.read_json(ROOT / "results" / build.TABLE3))
    if not table3["finished"]:
        assert "being measured" in text
    targets = box.evaluate("""b => [...b.querySelectorAll('a')].map(a => {
        const t = document.getElementById(a.getAttribute('href').slice(1));
        return [a.textContent, t ? t.textContent : null]; })""")
    assert {name for name, _ in targets} == {"Results", "Table 3"}
    assert all(heading and name in heading for name, heading in targets), targets
    above = page.evaluate("""[document.querySelector('aside.findings'),
        document.querySelector('.title-block h1')]
        .map(e => e.getBoundingClientRect().top + scrollY)""")
    assert above[1] < above[0] < HEIGHT  # under the title, on the first screen


def test_external_links_lead_somewhere_or_are_absent(wide):
    links = wide.page.evaluate("""[...document.querySelectorAll('a')]
        .map(a => [a.textContent.trim(), a.getAttribute('href') || ''])""")
    url = build.project().project_url()
    assert all(href for _, href in links), "a link without an address"
    external = [(t, h) for t, h in links if not h.startswith("#")]
    assert all(re.match(r"https://[\w-]+(\.[\w-]+)+/", h) for _, h in external)
    titles = {t: h for t, h in wide.page.evaluate(
        "[...document.querySelectorAll('.title-block a')]"
        ".map(a => [a.textContent, a.getAttribute('href')])")}  # fmt: skip
    assert (
        titles.get("The paper (arXiv:1706.03762)") == "https://arxiv.org/abs/1706.03762"
    )
    colab = [h for _, h in external if "colab.research.google.com" in h]
    if url:
        assert titles.get("Repository") == url
        assert colab and set(colab) == {build.project().colab_url(url)}
    else:  # not published yet: neither link is shown
        assert "Repository" not in titles and "Open in Colab" not in titles
        assert colab == []


def test_the_paper_and_this_reproduction_can_be_cited(wide):
    cite = next(
        h
        for t, h in wide.page.evaluate(
            "[...document.querySelectorAll('.title-block a')]"
            ".map(a => [a.textContent, a.getAttribute('href')])"
        )
        if "cite" in t.lower()
    )
    section = wide.page.evaluate(
        f"document.getElementById('{cite[1:]}').closest('section').textContent"
    )
    assert "@inproceedings" in section and "Attention Is All You Need" in section
    assert "Cite this reproduction" in section and "@software{" in section
    assert build.citation()["title"] in section


def test_the_footer_names_the_build_and_the_icon_is_inline(wide):
    stamp = wide.page.locator("footer .build-stamp").text_content()
    assert re.match(r"Built on \d{4}-\d{2}-\d{2} \(UTC\)", stamp)
    assert ("from commit" in stamp) == (ROOT / ".git").exists()
    icons = wide.page.evaluate(
        "[...document.querySelectorAll('link[rel~=icon]')].map(l => l.href)"
    )
    assert len(icons) == 1 and icons[0].startswith("data:image/svg+xml,")
    assert not [u for u in wide.requests if "favicon" in u]


def test_the_page_ends_with_results_citation_and_credits(wide):
    end = wide.page.evaluate("""(() => {
        const main = document.querySelector('main');
        const last = main.lastElementChild;
        const codes = [...document.querySelectorAll('main .cell.code')];
        return {tag: last.tagName, text: last.textContent,
                headings: [...last.querySelectorAll('h2')].map(h => h.textContent),
                lastCode: codes[codes.length - 1].textContent}; })()""")
    assert end["tag"] == "FOOTER"
    assert "__main__" not in end["lastCode"]
    assert any(re.match(r"Results|Conclusion", h) for h in end["headings"])
    assert "@inproceedings" in end["text"] and "Credits" in end["text"]


def search(page, width: int, query: str) -> dict:
    """Type ``query`` in the search box (the contents opened first on a phone), press
    Enter, and say what the page landed on and highlighted."""
    if width < 1100:
        page.click(".toc-button")
        page.wait_for_timeout(300)
    page.fill("#search-box", query)
    first = page.locator(".search-results a").first
    title = first.locator("strong").text_content()
    page.press("#search-box", "Enter")
    page.wait_for_timeout(300)
    return (
        page.evaluate("""(() => {
        const hits = [...document.querySelectorAll('.search-hit')];
        const r = hits.length ? hits[0].getBoundingClientRect() : null;
        return {count: hits.length,
                cell: hits.length && hits[0].matches('.cell.code'),
                text: hits.length ? hits[0].textContent : '',
                visible: !!r && r.height > 0 && r.top < innerHeight && r.bottom > 0,
                contentsOpen: document.body.classList.contains('toc-open')}; })()""")
        | {"title": title}
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_searching_subsequent_mask_lands_on_its_cell(fresh, width):
    landed = search(fresh(width).page, width, "subsequent_mask")
    assert landed["count"] == 1 and landed["cell"] and landed["visible"], landed
    assert "def subsequent_mask(" in landed["text"]
    assert not landed["contentsOpen"]
    assert "subsequent_mask" in landed["title"]


def test_searching_prose_lands_on_the_paragraph_and_highlights_it(fresh):
    landed = search(fresh(1280).page, 1280, "label smoothing")
    assert landed["count"] == 1 and landed["visible"], landed
    text = " ".join(landed["text"].lower().split())
    assert "label smoothing" in text or "label-smoothing" in text
    assert len(text) < 3000  # a paragraph or a cell, not a whole section


def test_code_comments_are_found(fresh):
    page = fresh(1280).page
    page.fill("#search-box", "word-start mark")
    titles = page.locator(".search-results a strong").all_text_contents()
    assert any(t.startswith("Code") for t in titles), titles


# --- Figures --------------------------------------------------------------------------


FIGURES = """[...document.querySelectorAll('main figure.plot img')]
    .filter(i => i.getBoundingClientRect().width > 0).map(i => ({
    natural: i.naturalWidth, shown: i.getBoundingClientRect().width,
    button: i.parentElement.matches('button.zoom')}))"""
# Every figure the page shows: the picture seen (of a figure with a phone layout, the
# layout shown), its size, its figure's and column's widths, and its data to read.
SHOWN_FIGURES = """[...document.querySelectorAll('main figure.plot')].map(f => {
    const seen = [...f.querySelectorAll('img')].filter(
        i => i.getBoundingClientRect().width > 0);
    const i = seen[0], r = i.getBoundingClientRect();
    const column = f.parentElement.getBoundingClientRect();
    return {alt: i.alt, src: i.src, seen: seen.length,
            layout: i.classList.contains('narrow') ? 'phone' : 'wide',
            natural: i.naturalWidth, shown: r.width, left: r.left, right: r.right,
            figure: f.clientWidth, scrolls: f.scrollWidth - f.clientWidth,
            column: [column.left, column.right]}; })"""


def figure_numbers(page) -> list:
    """:data:`SHOWN_FIGURES` with the size the smallest text of each is shown at (CSS
    px): the size its PNG records (else matplotlib's 10-pt labels) at the scale shown."""
    page.evaluate(OPEN_ALL)
    figures = page.evaluate(SHOWN_FIGURES)
    for f in figures:
        data = f.pop("src").split(",", 1)[1]
        points = build.png_size(data)[0] * 72 / (build.png_dpi(data) or 72)
        f["pt"] = build.smallest_text_pt(data)
        f["px"] = f["pt"] * f["shown"] / points  # CSS px per point, times its points
    return figures


def test_figures_larger_than_shown_open_fitted_to_the_screen_to_pinch(fresh):
    page = fresh(390).page
    viewport = page.evaluate(
        "document.querySelector('meta[name=viewport]').content.replace(/ /g, '')"
    )
    assert "user-scalable=no" not in viewport and "maximum-scale" not in viewport
    page.evaluate(OPEN_ALL)
    state = page.evaluate(FIGURES)
    assert state and all(
        s["button"] == (s["natural"] > s["shown"] * 1.1) for s in state
    )
    for button in page.locator("main figure.plot button.zoom").all():
        if not button.is_visible():
            continue
        button.scroll_into_view_if_needed()
        img = button.evaluate(
            "b => [b.querySelector('img').naturalWidth, b.getBoundingClientRect().width]"
        )
        button.focus()
        page.keyboard.press("Enter")
        large = page.evaluate("""(() => {
            const v = document.querySelector('.zoom-view');
            const i = v && v.querySelector('img');
            return i && {width: i.getBoundingClientRect().width, natural: i.naturalWidth,
                alt: i.alt, scroll: v.scrollWidth - v.clientWidth,
                touch: getComputedStyle(v).touchAction + ' '
                    + getComputedStyle(i).touchAction}; })()""")
        assert large is not None and large["alt"] and large["natural"] == img[0]
        # fitted: as wide as the screen allows (or its pixels), never wider
        assert large["width"] <= 390 and large["scroll"] <= 0
        assert large["width"] >= min(img[0], 370) - 1 and large["width"] > img[1]
        assert all(t in ("auto", "pinch-zoom", "manipulation")
                   for t in large["touch"].split())  # fmt: skip
        page.keyboard.press("Escape")
        assert page.evaluate("document.querySelector('.zoom-view')") is None
        assert page.evaluate("document.activeElement.matches('button.zoom')")


@pytest.mark.parametrize("width", WIDTHS)
def test_no_figure_is_wider_than_its_column_or_scrolls_sideways(fresh, width):
    page = fresh(width).page
    figures = figure_numbers(page)
    assert len(figures) >= 10
    for f in figures:
        print(
            f"\n{width} px: {f['alt'][:36]}…: {f['layout']} layout shown "
            f"{f['shown']:.0f} px in {f['figure']} px; {f['pt']:g}-pt text at "
            f"{f['px']:.1f} px"
        )
        assert f["seen"] == 1, f["alt"]
        assert f["scrolls"] <= 0, f["alt"]
        assert f["column"][0] - 0.5 <= f["left"] and f["right"] <= f["column"][1] + 0.5
    assert page.evaluate("document.documentElement.scrollWidth") <= width


@pytest.mark.parametrize("width", WIDTHS)
def test_every_figures_smallest_text_reads_at_11_px(fresh, width):
    small = [
        f"{f['alt'][:40]}: {f['px']:.1f} px"
        for f in figure_numbers(fresh(width).page)
        if f["px"] < build.LEGIBLE_PX
    ]
    assert small == [], "; ".join(small)


@pytest.fixture(scope="module")
def figures_site(tmp_path_factory, site) -> Path:
    """A page of the figures the project draws with their phone layouts, as the
    notebook shows them (after the real page, so KaTeX is there)."""
    new = nbformat.v4
    cells = [new.new_markdown_cell("# Figures\n\nWhat the project draws.")]
    for path in PHONE_LAID_OUT:
        png = base64.b64encode(path.read_bytes()).decode()
        output = new.new_output(
            "display_data",
            data={"image/png": png, "text/plain": "<Image>"},
            metadata={"image/png": {"alt": f"{path.name}, as the project draws it"}},
        )
        cells.append(new.new_code_cell(f"show({path.name!r})", outputs=[output]))
    where = tmp_path_factory.mktemp("figures")
    nbformat.write(new.new_notebook(cells=cells), where / "figures.ipynb")
    build.build(where / "figures.ipynb", where / "index.html")
    return where / "index.html"


PHONE_LAID_OUT = [
    ROOT / "figures" / "figure1_transformer.png",
    ROOT / "figures" / "figure2_attention.png",
    ROOT / "results" / "table3.png",
    ROOT / "results" / "table3-curves.png",
]


@pytest.mark.parametrize("width", WIDTHS)
def test_a_figure_with_a_phone_layout_shows_it_where_the_other_would_not_read(
    fresh, figures_site, width
):
    page = fresh(width, figures_site).page
    figures = figure_numbers(page)
    assert len(figures) == len(PHONE_LAID_OUT)
    for f in figures:
        print(
            f"\n{width} px: {f['alt'][:30]}: {f['layout']} layout, {f['pt']:g}-pt "
            f"text at {f['px']:.1f} px"
        )
        assert f["layout"] == ("wide" if width == 1280 else "phone"), f["alt"]
        assert f["px"] >= build.LEGIBLE_PX and f["scrolls"] <= 0, f["alt"]
    assert page.evaluate("document.documentElement.scrollWidth") <= width


def test_a_figure_shown_whole_has_no_enlarge_button(fresh):
    page = fresh(1920).page
    state = page.evaluate(FIGURES)
    assert all(s["button"] == (s["natural"] > s["shown"] * 1.1) for s in state)


def test_the_attention_maps_can_be_explored(fresh, explorer_site, site):
    visit = fresh(1280, explorer_site)
    page = visit.page
    figure = page.locator("figure.attention-explorer").first
    figure.scroll_into_view_if_needed()

    def fills():
        return figure.evaluate(
            "f => [...f.querySelectorAll('rect[data-q]')]"
            ".map(r => r.getAttribute('fill'))"
        )

    before = fills()
    assert before
    head = figure.locator('select[data-role="head"]')
    options = head.evaluate("s => [...s.options].map(o => o.value)")
    # two heads of a trained model may look alike at the colour scale's resolution
    # (both on one token); some other head of the layer must redraw the map
    redrawn = []
    for value in [v for v in options if v != head.input_value()]:
        head.select_option(value)
        redrawn.append(fills() != before)
    assert any(redrawn), "no other head changed the map"
    after_head = fills()
    layer = figure.locator('select[data-role="layer"]')
    options = layer.evaluate("s => [...s.options].map(o => o.value)")
    changed = []
    for value in [v for v in options if v != layer.input_value()]:
        layer.select_option(value)
        changed.append(fills() != after_head)
    assert any(changed), "no other layer changed the map"
    shown = figure.locator(".ae-shown").text_content()
    assert "layer" in shown and "head" in shown
    figure.locator("rect[data-q]").nth(3).hover()
    readout = figure.locator(".ae-readout").text_content()
    assert re.search(r"weight \d\.\d{3}", readout), readout
    labels = figure.evaluate(
        "f => [...f.querySelectorAll('svg text')].map(t => t.textContent)"
    )
    assert labels and not any("▁" in t for t in labels)
    kind = figure.locator('select[data-role="kind"]')
    assert len(kind.evaluate("s => [...s.options].map(o => o.value)")) == 3
    if explorer_site != site:  # the fixture's tokens: rows predict, columns are read
        kind.select_option("decoder")
        first = figure.evaluate(
            "f => [f.querySelector('text[data-row=\"0\"]').textContent,"
            " f.querySelector('text[data-col=\"0\"]').textContent]"
        )
        assert first == ["A", "<s>"]
    figure.locator(".ae-map").focus()

    def column():
        return int(
            re.search(r"column (\d+)", figure.locator(".ae-readout").text_content())[1]
        )

    page.keyboard.press("ArrowLeft")
    before = column()
    page.keyboard.press("ArrowRight")
    assert column() == before + 1
    assert visit.errors == [] and visit.left_file == []


@pytest.mark.parametrize("width", WIDTHS)
def test_the_explorer_has_a_colour_scale_presets_and_keeps_its_size(
    fresh, explorer_site, width
):
    page = fresh(width, explorer_site).page
    figure = page.locator("figure.attention-explorer").first
    figure.scroll_into_view_if_needed()
    scale = figure.locator(".ae-scale")
    assert scale.is_visible()
    ticks = scale.locator("svg text").all_text_contents()
    assert ticks[0] == "0" and ticks[-1] == "1"
    stops = scale.evaluate(
        "s => [...s.querySelectorAll('stop')].map(t => t.getAttribute('stop-color'))"
    )
    fills = figure.evaluate(
        "f => [...f.querySelectorAll('rect[data-q]')].map(r => r.getAttribute('fill'))"
    )
    assert stops[0] == "#f7fbff" and stops[-1] == "#08306b" and fills
    presets = figure.locator(".ae-presets button")
    assert presets.count() == 3
    for i in range(presets.count()):
        button = presets.nth(i)
        button.click()
        assert button.get_attribute("aria-pressed") == "true"
        kind = figure.locator('select[data-role="kind"]').input_value()
        label = button.text_content().lower()
        assert {"encoder": "encoder head", "decoder": "decoder head",
                "cross": "encoder–decoder"}[kind] in label  # fmt: skip
    size = figure.evaluate("""f => { const s = f.querySelector('.ae-map svg');
        const m = f.querySelector('.ae-map');
        return {shown: s.getBoundingClientRect().width, drawn: +s.getAttribute('width'),
                map: m.clientWidth, scrolls: m.scrollWidth > m.clientWidth,
                cue: m.classList.contains('scroll-more-right')}; }""")
    assert abs(size["shown"] - size["drawn"]) < 1, size  # never shrunk
    assert size["scrolls"] == (size["drawn"] > size["map"]) and (
        size["cue"] or not size["scrolls"]
    )
    assert page.evaluate("document.documentElement.scrollWidth") <= width


def test_the_explorer_replaces_the_static_maps_of_single_heads(wide):
    if not has_attention_maps(NB):
        pytest.skip("the notebook's stored outputs have no attention maps yet")
    order = wide.page.evaluate("""(() => {
        const f = document.querySelector('figure.attention-explorer');
        const cell = f.closest('.cell');
        return [...cell.querySelectorAll('pre.output, figure')].map(e =>
            e.matches('pre') ? 'text' : e.matches('.attention-explorer') ? 'explorer'
            : 'image'); })()""")
    assert order.count("explorer") == 1 and order.count("image") <= 1
    assert order.index("explorer") < (order + ["image"]).index("image")
    assert all(o == "text" for o in order[: order.index("explorer")])


def test_the_attention_maps_have_a_static_image_without_script(fresh, explorer_site):
    page = fresh(1280, explorer_site, java_script_enabled=False).page
    figure = page.locator("figure.attention-explorer").first
    assert figure.locator("svg rect[data-q]").count() > 0
    assert figure.locator(".ae-map svg").is_visible()
    assert not figure.locator(".ae-controls").is_visible()


# --- Colour ---------------------------------------------------------------------------


def luminance(rgb) -> float:
    def channel(c):
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a, b) -> float:
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def rgb(css: str):
    return tuple(int(float(x)) for x in re.findall(r"[\d.]+", css)[:3])


@pytest.mark.parametrize("scheme", ("light", "dark"))
def test_every_code_colour_passes_aa(fresh, scheme):
    page = fresh(1280, color_scheme=scheme).page
    page.evaluate(OPEN_ALL)
    pairs = page.evaluate("""(() => {
        const pairs = new Set();
        for (const box of document.querySelectorAll('main .highlight')) {
            const bg = getComputedStyle(box).backgroundColor;
            for (const el of [box, ...box.querySelectorAll('pre, span')])
                pairs.add(getComputedStyle(el).color + '|' + bg);
        }
        for (const pre of document.querySelectorAll('pre.output')) {
            let e = pre, bg = 'rgba(0, 0, 0, 0)';
            while (e && /rgba\\(0, 0, 0, 0\\)|transparent/.test(bg)) {
                bg = getComputedStyle(e).backgroundColor; e = e.parentElement; }
            pairs.add(getComputedStyle(pre).color + '|' + bg);
        }
        return [...pairs]; })()""")
    ratios = {p: contrast(rgb(p.split("|")[0]), rgb(p.split("|")[1])) for p in pairs}
    print(
        f"\n{scheme}: {len(ratios)} code colours, "
        f"lowest contrast {min(ratios.values()):.2f}"
    )
    assert len(ratios) >= 6
    assert {p: round(r, 2) for p, r in ratios.items() if r < 4.5} == {}


@pytest.mark.parametrize("scheme", ("light", "dark"))
def test_quotations_prose_and_figures_are_legible_in_both_schemes(fresh, scheme):
    page = fresh(1280, color_scheme=scheme).page
    colours = page.evaluate("""(() => {
        const get = (sel, what) => getComputedStyle(document.querySelector(sel))[what];
        return {body: [get('body', 'color'), get('body', 'backgroundColor')],
                quote: [get('figure.paper-quote', 'color'),
                        get('figure.paper-quote', 'backgroundColor')],
                caption: [get('figure.paper-quote figcaption', 'color'),
                          get('figure.paper-quote', 'backgroundColor')],
                link: [get('main a.xref', 'color'), get('body', 'backgroundColor')],
                findings: [get('aside.findings li', 'color'),
                           get('aside.findings', 'backgroundColor')],
                findingsLink: [get('aside.findings a', 'color'),
                               get('aside.findings', 'backgroundColor')],
                stamp: [get('.build-stamp', 'color'), get('body', 'backgroundColor')],
                katex: [get('.katex', 'color'), get('body', 'backgroundColor')],
                image: get('figure.plot img', 'backgroundColor')}; })()""")
    for name in (
        "body",
        "quote",
        "caption",
        "link",
        "katex",
        "findings",
        "findingsLink",
        "stamp",
    ):
        fg, bg = colours[name]
        assert contrast(rgb(fg), rgb(bg)) >= 4.5, (name, fg, bg)
    assert rgb(colours["image"]) == (255, 255, 255)  # figures keep a light frame
    dark = luminance(rgb(colours["body"][1])) < 0.1
    assert dark == (scheme == "dark")


# --- For a person ---------------------------------------------------------------------


SCROLL_TO = {  # screenshot name → script that scrolls to what it shows
    "top": "window.scrollTo(0, 0)",
    "formulas": """(() => {  // the section with the most typeset formulas
        const count = h => { let n = 0;
            for (let e = h.nextElementSibling; e && !/^H[1-3]$/.test(e.tagName);
                 e = e.nextElementSibling)
                n += e.querySelectorAll('.katex').length
                    + e.classList.contains('katex');
            return n; };
        const hs = [...document.querySelectorAll('main h2, main h3')];
        hs.reduce((a, b) => count(b) > count(a) ? b : a).scrollIntoView(); })()""",
    "attention": """(() => {  // what the model attends to: the explorer, else a figure
        const h = [...document.querySelectorAll('main :is(h2, h3)')]
            .find(e => /attends/i.test(e.textContent));
        const f = document.querySelector('figure.attention-explorer') || (h &&
            [...document.querySelectorAll('main figure.plot')].find(
                f => h.compareDocumentPosition(f) & Node.DOCUMENT_POSITION_FOLLOWING));
        (f || h || document.body).scrollIntoView(); })()""",
    "part-4": "document.getElementById('part-4').scrollIntoView()",
}


def test_screenshots_for_a_person(fresh, explorer_site):
    SHOTS.mkdir(parents=True, exist_ok=True)
    for width, scheme in ((1280, "light"), (390, "light"), (1280, "dark")):
        page = fresh(width, color_scheme=scheme).page
        for name, script in SCROLL_TO.items():
            page.evaluate(script)
            page.wait_for_timeout(50)
            suffix = "-dark" if scheme == "dark" else ""
            path = SHOTS / f"{name}-{width}{suffix}.png"
            page.screenshot(path=str(path))
            assert path.stat().st_size > 0
    page = fresh(1280, explorer_site).page
    figure = page.locator("figure.attention-explorer").first
    figure.scroll_into_view_if_needed()
    figure.locator("rect[data-q]").nth(8).hover()
    figure.screenshot(path=str(SHOTS / "attention-explorer.png"))
    shutil.copyfile(SHOTS / "top-1280.png", SHOTS / "web_page.png")  # for figures/


def test_on_a_phone_the_contents_take_the_focus_when_they_open(fresh):
    page = fresh(390).page
    page.click(".toc-button")
    assert page.evaluate("!!document.activeElement.closest('nav.toc')")
    page.keyboard.press("Escape")
    assert page.evaluate("document.activeElement.matches('.toc-button')")
