// Typesets the web page's formulas with KaTeX when the page is built (make html),
// so the page needs no script to show them. stdin: a JSON list of {tex, display};
// stdout: a JSON list of HTML strings in the same order. The first formula KaTeX
// cannot parse stops the build.
"use strict";
const katex = require("katex");

let input = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (chunk) => { input += chunk; });
process.stdin.on("end", () => {
  const html = JSON.parse(input).map(({ tex, display }, i) => {
    try {
      // strict "ignore": Unicode such as "…" inside formulas is written on purpose.
      return katex.renderToString(tex, {
        displayMode: display, throwOnError: true, strict: "ignore",
      });
    } catch (err) {
      process.stderr.write(`formula ${i + 1} ${JSON.stringify(tex)}: ${err.message}\n`);
      process.exit(1);
    }
  });
  process.stdout.write(JSON.stringify(html));
});
