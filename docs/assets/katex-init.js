// Renders the math that pymdownx.arithmatex (generic mode) leaves as \( \) and \[ \] spans.
function renderTreecompileMath() {
  for (const el of document.querySelectorAll(".arithmatex")) {
    renderMathInElement(el, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: true,
    });
  }
}
if (typeof document$ !== "undefined") {
  document$.subscribe(renderTreecompileMath);
} else {
  document.addEventListener("DOMContentLoaded", renderTreecompileMath);
}
