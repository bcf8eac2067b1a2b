"""The notebook as a web page (make html), checked in a real browser: offline, typeset, readable.

Headless Chromium is the system's (Debian's ``chromium``), driven by playwright; no browser is
downloaded. The page is built once from the committed notebook and its stored outputs.
Screenshots for a person to look at are written to runs/html/.
"""
import importlib.util
import re
import shutil
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "annotated_transformer.ipynb"
SHOTS = ROOT / "runs" / "html"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KATEX_INSTALLED = (ROOT / "web" / "node_modules" / "katex" / "package.json").is_file()
# Headless Chromium as root, offline and quiet: no sandbox (root), no GPU, and none of the
# background requests (updates, sync, first-run pages) that would try to reach the network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-default-apps",
                 "--disable-extensions", "--no-default-browser-check", "--metrics-recording-only"]
WIDTHS = (1280, 390)

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="playwright is not installed (make install)"),
    pytest.mark.skipif(shutil.which("node") is None or (shutil.which("npm") is None and not KATEX_INSTALLED),
                       reason="Node.js and npm are needed to fetch and run KaTeX (apt-get install nodejs npm)"),
]


def markdown_formulas(notebook: Path) -> int:
    """Formulas in the notebook's Markdown, counted from its text: ``$$…$$`` and ``$…$`` outside code."""
    count = 0
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        text = re.sub(r"^ {0,3}> ?", "", cell.source, flags=re.M)  # block quotes: the text inside
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # fenced code
        text = re.sub(r"(`+)(?!`).+?(?<!`)\1(?!`)", "", text, flags=re.S)  # code spans
        display = re.findall(r"\$\$.+?\$\$", text, flags=re.S)
        text = re.sub(r"\$\$.+?\$\$", "", text, flags=re.S)
        count += len(display) + len(re.findall(r"(?<!\\)\$[^$]+?(?<!\\)\$", text, flags=re.S))
    return count


def attributions(notebook: Path) -> int:
    """The paper's quotations in the notebook: each ends with one "— §…" (or "— Abstract") line under its block quote(s)."""
    cells = nbformat.read(notebook, as_version=4).cells
    return sum(len(re.findall(r"^>.*\n\s*\n— ", c.source, flags=re.M)) for c in cells if c.cell_type == "markdown")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("web_page_build", ROOT / "web" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    out = tmp_path_factory.mktemp("site") / "index.html"
    try:
        build.build(NB, out)
    except build.MissingTool as err:  # no npm, or KaTeX not fetched yet and no network
        pytest.skip(str(err))
    return out


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Visit:
    """One page load at a given width, recording console errors and every request that is not local."""

    def __init__(self, browser, site: Path, width: int):
        self.context = browser.new_context(viewport={"width": width, "height": 900})
        self.left_file, self.errors = [], []

        def block(route):
            self.left_file.append(route.request.url)
            route.abort()

        self.context.route(re.compile(r"^(?!file:|data:)"), block)  # http, https, ws, …: refused and noted
        self.page = self.context.new_page()
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(site.as_uri(), wait_until="load")

    def close(self):
        self.context.close()


@pytest.fixture(scope="module")
def wide(browser, site):
    visit = Visit(browser, site, 1280)
    yield visit
    visit.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_page_requests_nothing_beyond_file_and_logs_no_errors(browser, site, width):
    visit = Visit(browser, site, width)
    try:
        visit.page.wait_for_timeout(300)  # anything the page would fetch after load
        assert visit.left_file == [], f"requests that left file://: {visit.left_file}"
        assert visit.errors == []
    finally:
        visit.close()


def test_every_formula_is_typeset_and_no_tex_is_left_in_the_text(wide):
    page = wide.page
    typeset = page.evaluate("document.querySelectorAll('main .katex').length")
    assert typeset == markdown_formulas(NB)
    assert page.evaluate("document.querySelectorAll('.katex-error').length") == 0
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
        return imgs.map(i => ({w: i.naturalWidth, h: i.naturalHeight, alt: i.alt.trim()}));
    }""")
    stored = sum("image/png" in o.get("data", {}) for c in nbformat.read(NB, as_version=4).cells
                 if c.cell_type == "code" for o in c.outputs)
    assert len(images) >= stored > 0
    assert all(i["w"] > 0 and i["h"] > 0 for i in images)
    assert all(i["alt"] for i in images), [i for i in images if not i["alt"]]


def test_a_clicked_figure_opens_at_its_natural_size_and_escape_closes_it(browser, site):
    visit = Visit(browser, site, 390)
    try:
        page = visit.page
        figure = page.locator("main figure.plot img").last
        figure.scroll_into_view_if_needed()
        shown, natural = figure.evaluate("i => [i.getBoundingClientRect().width, i.naturalWidth]")
        assert shown < natural  # on a phone the page shows it scaled down
        figure.click()
        large = page.evaluate("""(() => { const i = document.querySelector('.zoom-view img');
            return i && [i.getBoundingClientRect().width, i.naturalWidth, i.alt]; })()""")
        assert large is not None and large[0] == large[1] == natural and large[2]
        page.keyboard.press("Escape")
        assert page.evaluate("document.querySelector('.zoom-view')") is None
    finally:
        visit.close()


def test_every_contents_link_lands_on_a_heading(wide):
    page = wide.page
    hrefs = page.evaluate("[...document.querySelectorAll('nav.toc a')].map(a => a.getAttribute('href'))")
    headings = page.evaluate("""[...document.querySelectorAll('main h1, main h2, main h3')]
        .map(h => h.id + '|' + h.tagName + '|' + h.textContent)""")
    parts_and_sections = [h.split("|")[0] for h in headings
                          if h.split("|")[1] == "H1" or h.split("|")[2].startswith("§")]
    assert parts_and_sections and {"#" + i for i in parts_and_sections} <= set(hrefs)
    for href in hrefs:
        page.click(f'nav.toc a[href="{href}"]')
        landed = page.evaluate("""() => {
            const el = document.getElementById(decodeURIComponent(location.hash.slice(1)));
            return el && {tag: el.tagName, top: el.getBoundingClientRect().top, height: innerHeight};
        }""")
        assert landed is not None, f"{href} leads nowhere"
        assert landed["tag"] in ("H1", "H2", "H3") and 0 <= landed["top"] < landed["height"], (href, landed)


@pytest.mark.parametrize("width", WIDTHS)
def test_nothing_overflows_the_page_and_wide_code_scrolls(browser, site, width):
    visit = Visit(browser, site, width)
    try:
        page = visit.page
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        clipped = page.evaluate("""[...document.querySelectorAll('pre, .katex-display, table')]
            .filter(e => e.scrollWidth > e.clientWidth + 1
                    && !['auto', 'scroll'].includes(getComputedStyle(e).overflowX)
                    && !['auto', 'scroll'].includes(getComputedStyle(e.parentElement).overflowX))
            .map(e => e.textContent.slice(0, 60))""")
        assert clipped == []
    finally:
        visit.close()


def test_the_papers_words_stand_apart_from_our_commentary(wide):
    page = wide.page
    quotes = page.evaluate("""[...document.querySelectorAll('figure.paper-quote')].map(f => ({
        caption: (f.querySelector('figcaption') || {textContent: ''}).textContent.trim(),
        background: getComputedStyle(f).backgroundColor, font: getComputedStyle(f).fontFamily}))""")
    loose = page.evaluate("[...document.querySelectorAll('blockquote')].filter(q => !q.closest('figure.paper-quote')).length")
    prose = page.evaluate("""(() => { const p = document.querySelector('main .prose > p');
        return {background: getComputedStyle(p).backgroundColor, font: getComputedStyle(p).fontFamily}; })()""")
    assert len(quotes) == attributions(NB) and loose == 0
    assert all(re.match(r"— (§\d|Abstract)", q["caption"]) for q in quotes), [q["caption"] for q in quotes]
    assert all(q["background"] != prose["background"] and q["font"] != prose["font"] for q in quotes)


def test_no_prompts_progress_bars_or_warnings(wide):
    text = wide.page.evaluate("document.querySelector('main').innerText")
    assert not re.search(r"\b(In|Out)\s*\[\s*\d*\s*\]:", text)
    assert not re.search(r"\d+%\|", text), "progress bar"
    assert not re.search(r"\w*Warning:", text)


SCROLL_TO = {  # screenshot name → script that scrolls to what it shows
    "top": "window.scrollTo(0, 0)",
    "formulas": """(() => {  // the section with the most typeset formulas
        const count = h => { let n = 0;
            for (let e = h.nextElementSibling; e && !/^H[1-3]$/.test(e.tagName); e = e.nextElementSibling)
                n += e.querySelectorAll('.katex').length + e.classList.contains('katex');
            return n; };
        const hs = [...document.querySelectorAll('main h2, main h3')];
        hs.reduce((a, b) => count(b) > count(a) ? b : a).scrollIntoView(); })()""",
    "attention": """(() => {  // the first figure after the heading of the attention maps
        const h = [...document.querySelectorAll('main h3')].find(e => e.textContent.startsWith('What the model attends'));
        [...document.querySelectorAll('main figure.plot')]
            .find(f => h.compareDocumentPosition(f) & Node.DOCUMENT_POSITION_FOLLOWING).scrollIntoView(); })()""",
}


def test_screenshots_for_a_person(browser, site):
    SHOTS.mkdir(parents=True, exist_ok=True)
    for width in WIDTHS:
        visit = Visit(browser, site, width)
        try:
            for name, script in SCROLL_TO.items():
                visit.page.evaluate(script)
                path = SHOTS / f"{name}-{width}.png"
                visit.page.screenshot(path=str(path))
                assert path.stat().st_size > 0
        finally:
            visit.close()
