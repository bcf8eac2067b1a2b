// The article's only script (make html); the page reads fine without it. It marks the
// section being read in the contents, puts the contents behind a button on narrow
// screens, opens skippable sections that a link or printing needs, enlarges figures,
// searches the page, and draws the attention maps to explore.
"use strict";
(function () {
  const root = document.documentElement;
  root.classList.add("js");
  const $ = (sel, where) => (where || document).querySelector(sel);
  const $$ = (sel, where) => Array.from((where || document).querySelectorAll(sel));
  const narrow = window.matchMedia("(max-width: 1099.98px)");
  const toc = $("nav.toc");
  const tocButton = $(".toc-button");

  // Collapsed sections open for what lands in them: a link, a search result, printing.
  function byHash(hash) {
    try {
      return document.getElementById(decodeURIComponent(hash.slice(1)));
    } catch (err) {
      return null;
    }
  }
  function reveal(el) {
    for (let d = el && el.parentElement.closest("details"); d;
      d = d.parentElement.closest("details")) {
      d.open = true;
    }
  }
  document.addEventListener("click", function (event) {
    const a = event.target.closest && event.target.closest('a[href^="#"]');
    if (!a) {
      return;
    }
    reveal(byHash(a.getAttribute("href")));
    if (toc.contains(a) && narrow.matches) {
      setContents(false);
    }
  });
  function goToHash() {
    const el = byHash(location.hash);
    if (el && el.parentElement.closest("details:not([open])")) {
      reveal(el);
      el.scrollIntoView();
    }
  }
  window.addEventListener("hashchange", goToHash);
  if (location.hash) {
    goToHash();
  }
  let closedForPrint = [];
  window.addEventListener("beforeprint", function () {
    closedForPrint = $$("details:not([open])");
    closedForPrint.forEach((d) => { d.open = true; });
  });
  window.addEventListener("afterprint", function () {
    closedForPrint.forEach((d) => { d.open = false; });
    closedForPrint = [];
  });

  // Narrow screens: the contents behind a button always in reach, closed by a tap
  // outside them; a switch wraps code, on by default on a phone.
  $(".toolbar").hidden = false;
  document.addEventListener("click", function (event) {
    if (document.body.classList.contains("toc-open") &&
      !toc.contains(event.target) && !tocButton.contains(event.target)) {
      setContents(false);
    }
  });
  function setContents(open) {
    document.body.classList.toggle("toc-open", open);
    tocButton.setAttribute("aria-expanded", String(open));
    if (open) {
      ($(".toc-list a.current") || $("#search-box")).focus({ preventScroll: false });
      keepInView(current);
    } else if (toc.contains(document.activeElement)) {
      tocButton.focus();
    }
  }
  tocButton.addEventListener("click", function () {
    setContents(!document.body.classList.contains("toc-open"));
  });
  const wrapButton = $(".wrap-button");
  function setWrap(on) {
    root.classList.toggle("wrap-code", on);
    wrapButton.setAttribute("aria-pressed", String(on));
  }
  setWrap(window.matchMedia("(max-width: 599.98px)").matches);
  wrapButton.addEventListener("click", function () {
    setWrap(!root.classList.contains("wrap-code"));
    markScrollers();
  });

  // A copy button on every code block: the code alone (every line of a cell, folded
  // ones too; no outputs).
  function codeOf(block) {
    const pres = block.matches("pre") ? [block] : $$("pre", block);
    return pres.map((p) => p.textContent.replace(/\n$/, "")).join("\n");
  }
  function copyText(text) {
    if (navigator.clipboard && navigator.clipboard.writeText) {
      return navigator.clipboard.writeText(text).catch(() => copyByHand(text));
    }
    return Promise.resolve(copyByHand(text));
  }
  function copyByHand(text) {
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const codeBlocks = $$("main .source").concat($$("main pre").filter(
    (p) => !p.closest(".source") && !p.matches(".output") && !p.closest(".output")));
  codeBlocks.forEach(function (block) {
    let holder = block.matches("pre") ? block.closest(".highlight") : block;
    if (!holder) { // a bare <pre>: the button goes beside it, never inside it
      holder = document.createElement("div");
      block.replaceWith(holder);
      holder.append(block);
    }
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy-button";
    button.textContent = "Copy";
    button.setAttribute("aria-label", "Copy the code");
    button.addEventListener("click", function () {
      copyText(codeOf(block)).then(function () {
        button.textContent = "Copied";
        setTimeout(() => { button.textContent = "Copy"; }, 1500);
      });
    });
    holder.classList.add("has-copy");
    holder.prepend(button);
  });

  // The section being read: marked in the contents, which scroll to keep it in view.
  const entries = new Map(
    $$(".toc-list a").map((a) => [a.getAttribute("href").slice(1), a]));
  const headings = $$("main :is(h1, h2, h3)[id]").filter((h) => entries.has(h.id));
  let current = null;
  let pending = false;
  function keepInView(a) {
    if (!a || toc.scrollHeight <= toc.clientHeight) {
      return;
    }
    const box = toc.getBoundingClientRect();
    const head = $(".toc-head", toc).getBoundingClientRect().bottom;
    const r = a.getBoundingClientRect();
    if (r.top < Math.max(box.top, head) || r.bottom > box.bottom) {
      toc.scrollTop += r.top - box.top - toc.clientHeight / 2;
    }
  }
  function mark() {
    pending = false;
    const line = Math.min(window.innerHeight * 0.3, 240);
    let found = headings[0];
    for (const h of headings) {
      const r = h.getBoundingClientRect();
      if (r.height === 0) {
        continue; // inside a closed section
      }
      if (r.top > line) {
        break;
      }
      found = h;
    }
    if (window.innerHeight + window.scrollY >= root.scrollHeight - 2) {
      const shown = headings.filter((h) => h.getBoundingClientRect().height > 0);
      found = shown.pop() || found;
    }
    const a = found && entries.get(found.id);
    if (!a || a === current) {
      return;
    }
    if (current) {
      current.classList.remove("current");
      current.removeAttribute("aria-current");
    }
    a.classList.add("current");
    a.setAttribute("aria-current", "location");
    current = a;
    keepInView(a);
  }
  window.addEventListener("scroll", function () {
    if (!pending) {
      pending = true;
      window.requestAnimationFrame(mark);
    }
  }, { passive: true });
  mark();

  // Figures larger than shown open from a button, fitted to the screen, where a reader
  // can pinch them larger; Escape or a click close.
  let opener = null;
  function closeZoom() {
    const view = $(".zoom-view");
    if (view) {
      view.remove();
      if (opener) {
        opener.focus();
      }
    }
  }
  function openZoom(img, button) {
    const view = document.createElement("div");
    view.className = "zoom-view";
    view.setAttribute("role", "dialog");
    view.setAttribute("aria-modal", "true");
    view.setAttribute("aria-label", img.alt);
    const close = document.createElement("button");
    close.type = "button";
    close.className = "zoom-close";
    close.textContent = "Close (Esc)";
    const large = document.createElement("img");
    large.src = img.currentSrc || img.src;
    large.alt = img.alt;
    view.append(close, large);
    view.addEventListener("click", closeZoom);
    document.body.appendChild(view);
    opener = button;
    close.focus();
  }
  function fitZoom() {
    $$("main img").forEach(function (img) {
      const shown = img.getBoundingClientRect().width;
      const larger = shown > 0 && img.naturalWidth > shown * 1.1;
      const parent = img.parentElement;
      const wrapper = parent.classList.contains("zoom") ? parent : null;
      if (larger && !wrapper) {
        const button = document.createElement("button");
        button.type = "button";
        button.className = "zoom";
        button.title = "Show larger";
        img.replaceWith(button);
        button.appendChild(img);
        button.addEventListener("click", () => openZoom(img, button));
      } else if (!larger && wrapper && shown > 0) {
        wrapper.replaceWith(img);
      }
    });
  }
  let resizing = 0;
  window.addEventListener("resize", function () {
    clearTimeout(resizing);
    resizing = setTimeout(fitZoom, 150);
  });
  $$("details").forEach((d) => d.addEventListener("toggle", fitZoom));
  fitZoom();
  window.addEventListener("load", fitZoom);
  document.addEventListener("keydown", function (event) {
    if (event.key === "Escape") {
      closeZoom();
      if (document.body.classList.contains("toc-open")) {
        setContents(false);
      }
    }
  });

  // A table of many columns that is wider than the article, on a screen wide enough
  // to show it as a table (not as cards), steps its text down (never under 11.5 px)
  // until its rows fit on one line; failing that, its cells of long words wrap too.
  const TABLE_SIZES = [0.84, 0.8, 0.76, 0.72];
  function fitTables() {
    $$("main table.many-columns").forEach(function (table) {
      table.classList.remove("wrap-cells");
      table.style.fontSize = "";
      if (window.innerWidth < 600) {
        return;
      }
      for (const wrap of [false, true]) {
        table.classList.toggle("wrap-cells", wrap);
        for (const size of TABLE_SIZES) {
          table.style.fontSize = size + "rem";
          if (table.scrollWidth <= table.clientWidth + 1) {
            return;
          }
        }
      }
    });
  }
  fitTables();
  window.addEventListener("resize", function () {
    clearTimeout(fitTables.timer);
    fitTables.timer = setTimeout(fitTables, 150);
  });
  $$("details").forEach((d) => d.addEventListener("toggle", fitTables));

  // Whatever scrolls sideways (formulas, figures, tables, code, the attention map)
  // fades at the edge where more is hidden.
  const SCROLLERS = "main :is(.katex-display, figure.plot, .ae-map, table, pre, " +
    ".output.html)";
  function markScroller(el) {
    const more = el.scrollWidth - el.clientWidth;
    el.classList.toggle("scroll-more-right", more > 1 && el.scrollLeft < more - 1);
    el.classList.toggle("scroll-more-left", more > 1 && el.scrollLeft > 1);
  }
  function markScrollers() {
    $$(SCROLLERS).forEach(markScroller);
  }
  document.addEventListener("scroll", function (event) {
    const el = event.target;
    if (el.matches && el.matches(SCROLLERS)) {
      markScroller(el);
    }
  }, { capture: true, passive: true });
  window.addEventListener("resize", function () {
    clearTimeout(markScrollers.timer);
    markScrollers.timer = setTimeout(markScrollers, 150);
  });
  $$("details").forEach((d) => d.addEventListener("toggle", markScrollers));
  window.addEventListener("load", markScrollers);
  markScrollers();

  // Search: headings, prose and code (the names it defines, its comments), from the
  // index the build embedded. A result scrolls to the paragraph or cell that matches
  // and highlights it.
  const form = $("form.search");
  const box = $("#search-box");
  const list = $(".search-results");
  const index = JSON.parse($("#search-index").textContent);
  form.hidden = false;
  form.addEventListener("submit", function (event) {
    event.preventDefault();
    const first = $("a", list);
    if (first) {
      first.click();
    }
  });
  function snippet(text, at, length) {
    const span = document.createElement("span");
    const start = Math.max(0, at - 50);
    const mark = document.createElement("mark");
    mark.textContent = text.slice(at, at + length);
    span.append((start ? "…" : "") + text.slice(start, at), mark,
      text.slice(at + length, at + length + 70) + "…");
    return span;
  }
  const BLOCKS = "p, li, figure, table, .cell.code, pre, blockquote";
  function matchingBlock(target, words) {
    // the first paragraph, item or cell of the target's section that has the words
    if (target.matches(".cell.code")) {
      return target;
    }
    const section = target.closest("section") || target;
    for (const block of $$(BLOCKS, section)) {
      if (block.closest("section") !== section || block.parentElement.closest(BLOCKS)) {
        continue; // a subsection's, or inside a block already looked at
      }
      const text = block.textContent.toLowerCase();
      if (words.every((w) => text.includes(w))) {
        return block;
      }
    }
    return target;
  }
  let lit = null;
  function goTo(id, query) {
    const target = document.getElementById(id);
    if (!target) {
      return;
    }
    const words = query.split(" ").filter(Boolean);
    const block = matchingBlock(target, words);
    reveal(block);
    if (block.closest("details:not([open])") || block.matches("details")) {
      block.open = true;
    }
    history.replaceState(null, "", "#" + id);
    if (lit) {
      lit.classList.remove("search-hit");
    }
    lit = block;
    block.classList.add("search-hit");
    block.scrollIntoView({ block: "center" });
    if (narrow.matches) {
      setContents(false);
    }
  }
  list.addEventListener("click", function (event) {
    const a = event.target.closest("a[data-id]");
    if (a) {
      event.preventDefault();
      event.stopPropagation();
      goTo(a.dataset.id, a.dataset.query);
    }
  });
  function score(entry, query, words) {
    const [, title, text, kind] = entry;
    const t = title.toLowerCase();
    const x = text.toLowerCase();
    if (!words.every((w) => t.includes(w) || x.includes(w))) {
      return 0;
    }
    let points = (t.includes(query) ? 100 : 0) + (x.includes(query) ? 20 : 0) +
      words.filter((w) => t.includes(w)).length * 10;
    if (kind === "code") {
      const names = t.replace(/^code: /, "").split(", ");
      const name = query.replace(/ /g, "_");
      points += names.includes(name) ? 300 : 0; // where it is defined comes first
    }
    return points;
  }
  box.addEventListener("input", function () {
    const query = box.value.trim().toLowerCase().replace(/\s+/g, " ");
    const words = query.split(" ").filter(Boolean);
    list.textContent = "";
    if (query.length < 2) {
      return;
    }
    const hits = [];
    for (const entry of index) {
      const points = score(entry, query, words);
      if (points > 0) {
        hits.push({ entry, points });
      }
    }
    hits.sort((a, b) => b.points - a.points);
    for (const { entry } of hits.slice(0, 12)) {
      const [id, title, text] = entry;
      const li = document.createElement("li");
      const a = document.createElement("a");
      a.href = "#" + id;
      a.dataset.id = id;
      a.dataset.query = query;
      const strong = document.createElement("strong");
      strong.textContent = title;
      a.append(strong);
      const x = text.toLowerCase();
      const whole = x.indexOf(query) >= 0;
      const at = whole ? x.indexOf(query) : x.indexOf(words[0]);
      if (at >= 0) {
        a.append(snippet(text, at, whole ? query.length : words[0].length));
      }
      li.append(a);
      list.append(li);
    }
    if (!hits.length) {
      const li = document.createElement("li");
      li.textContent = "Nothing on the page mentions that.";
      list.append(li);
    }
  });

  // Attention maps to explore: kind, layer and head; hover or arrow keys read a weight.
  const BLUES = [[0, [247, 251, 255]], [0.25, [198, 219, 239]], [0.5, [107, 174, 214]],
    [0.75, [33, 113, 181]], [1, [8, 48, 107]]]; // as web/build.py's BLUES
  const KINDS = {
    encoder: "Encoder self-attention",
    decoder: "Decoder self-attention (masked)",
    cross: "Decoder–encoder attention",
  };
  function blue(w) {
    w = Math.min(1, Math.max(0, w));
    for (let i = 1; i < BLUES.length; i++) {
      const [a, ca] = BLUES[i - 1];
      const [b, cb] = BLUES[i];
      if (w <= b) {
        const t = (w - a) / (b - a);
        return "#" + ca.map((x, j) => Math.round(x + (cb[j] - x) * t)
          .toString(16).padStart(2, "0")).join("");
      }
    }
    return "#08306b";
  }
  const esc = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;")
    .replace(/>/g, "&gt;");
  const label = (t) => t.replace(/▁/g, "") || "␣";
  function heatMap(weights, rows, cols) { // drawn as build.py's attention_svg draws it
    const nq = weights.length;
    const nk = nq ? weights[0].length : 0;
    rows = Array.from({ length: nq },
      (_, i) => (i < rows.length ? label(rows[i]) : ""));
    cols = Array.from({ length: nk },
      (_, j) => (j < cols.length ? label(cols[j]) : ""));
    const cell = Math.max(10, Math.min(26, Math.floor(560 / Math.max(nk, 1))));
    const left = 12 + 7 * Math.max(1, ...rows.map((t) => t.length));
    const top = 12 + 7 * Math.max(1, ...cols.map((t) => t.length));
    const width = left + cell * nk + 4;
    const height = top + cell * nq + 4;
    const out = [`<svg class="ae-svg" viewBox="0 0 ${width} ${height}" ` +
      `width="${width}" height="${height}" role="img" ` +
      'aria-label="attention weights heat map">'];
    rows.forEach(function (t, i) {
      const y = top + cell * i + cell / 2 + 4;
      out.push(`<text x="${left - 6}" y="${y}" text-anchor="end" data-row="${i}">` +
        `${esc(t)}</text>`);
    });
    cols.forEach(function (t, j) {
      const x = left + cell * j + cell / 2 + 4;
      const y = top - 6;
      out.push(`<text x="${x}" y="${y}" transform="rotate(-90 ${x} ${y})" ` +
        `data-col="${j}">${esc(t)}</text>`);
    });
    weights.forEach((row, i) => row.forEach(function (w, j) {
      out.push(`<rect x="${left + cell * j}" y="${top + cell * i}" width="${cell}" ` +
        `height="${cell}" fill="${blue(w)}" data-q="${i}" data-k="${j}"/>`);
    }));
    out.push(`<rect class="ae-focus" width="${cell}" height="${cell}" ` +
      'visibility="hidden"/>');
    return out.join("") + "</svg>";
  }
  $$("figure.attention-explorer").forEach(function (figure) {
    const data = JSON.parse($(".ae-data", figure).textContent);
    const state = Object.assign({}, data.start, { q: 0, k: 0 });
    const select = {};
    ["kind", "layer", "head"].forEach((role) => {
      select[role] = $(`select[data-role="${role}"]`, figure);
    });
    const map = $(".ae-map", figure);
    const shown = $(".ae-shown", figure);
    const readout = $(".ae-readout", figure);
    Object.keys(data.maps).forEach(function (k) {
      select.kind.add(new Option(KINDS[k] || k, k));
    });
    function numbers(sel, n, value) {
      sel.textContent = "";
      for (let i = 0; i < n; i++) {
        sel.add(new Option(String(i + 1), String(i)));
      }
      sel.value = String(value);
    }
    function axes() {
      const s = data.sentence || {};
      const out = s.tgt_out || s.tgt; // the token each decoder position predicts
      const axes = {
        encoder: [s.src, s.src], decoder: [out, s.tgt], cross: [out, s.src],
      };
      return axes[state.kind].map((t) => t || []);
    }
    function weights() {
      return data.maps[state.kind][state.layer][state.head];
    }
    function draw() {
      const layers = data.maps[state.kind];
      state.layer = Math.min(state.layer, layers.length - 1);
      state.head = Math.min(state.head, layers[state.layer].length - 1);
      select.kind.value = state.kind;
      numbers(select.layer, layers.length, state.layer);
      numbers(select.head, layers[state.layer].length, state.head);
      const [rows, cols] = axes();
      map.innerHTML = heatMap(weights(), rows, cols);
      shown.textContent = `${KINDS[state.kind]}, layer ${state.layer + 1}, ` +
        `head ${state.head + 1}`;
      presetButtons.forEach(function ([button, p]) {
        const on = p.kind === state.kind && p.layer === state.layer &&
          p.head === state.head;
        button.setAttribute("aria-pressed", String(on));
      });
      markScroller(map);
    }
    // Presets: the sharpest head of each kind, one click away.
    const presetButtons = (data.presets || []).map(function (p) {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = p.label;
      button.addEventListener("click", function () {
        Object.assign(state, { kind: p.kind, layer: p.layer, head: p.head });
        draw();
      });
      $(".ae-presets", figure).append(button);
      return [button, p];
    });
    function read(q, k) {
      const w = weights();
      state.q = Math.max(0, Math.min(w.length - 1, q));
      state.k = Math.max(0, Math.min(w[0].length - 1, k));
      const [rows, cols] = axes();
      const cell = $(`rect[data-q="${state.q}"][data-k="${state.k}"]`, map);
      const focus = $(".ae-focus", map);
      focus.setAttribute("x", cell.getAttribute("x"));
      focus.setAttribute("y", cell.getAttribute("y"));
      focus.setAttribute("visibility", "visible");
      $$("text.ae-on", map).forEach((t) => t.classList.remove("ae-on"));
      $(`text[data-row="${state.q}"]`, map).classList.add("ae-on");
      $(`text[data-col="${state.k}"]`, map).classList.add("ae-on");
      const who = state.kind === "encoder" ? ["source", "source"]
        : state.kind === "decoder" ? ["target", "target"] : ["target", "source"];
      const row = label(rows[state.q] || "?");
      const col = label(cols[state.k] || "?");
      readout.textContent = `${who[0]} token “${row}” (row ${state.q + 1}) ` +
        `attends to ${who[1]} token “${col}” (column ${state.k + 1}) with weight ` +
        w[state.q][state.k].toFixed(3);
    }
    select.kind.addEventListener("change", function () {
      state.kind = select.kind.value;
      draw();
    });
    select.layer.addEventListener("change", function () {
      state.layer = +select.layer.value;
      draw();
    });
    select.head.addEventListener("change", function () {
      state.head = +select.head.value;
      draw();
    });
    map.addEventListener("mouseover", function (event) {
      const cell = event.target.closest("rect[data-q]");
      if (cell) {
        read(+cell.dataset.q, +cell.dataset.k);
      }
    });
    map.addEventListener("keydown", function (event) {
      const step = {
        ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1],
      };
      if (step[event.key]) {
        event.preventDefault();
        read(state.q + step[event.key][0], state.k + step[event.key][1]);
      }
    });
    map.addEventListener("focus", () => read(state.q, state.k));
    $(".ae-controls", figure).hidden = false;
    draw();
  });
})();
