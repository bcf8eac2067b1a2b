// The article's only script (make html): open the contents on wide screens, and show a
// figure at its natural size when it is clicked (click again or press Escape to close).
"use strict";
(function () {
  const contents = document.querySelector(".toc details");
  if (contents && window.matchMedia("(min-width: 1100px)").matches) {
    contents.open = true;
  }
  function close() {
    const view = document.querySelector(".zoom-view");
    if (view) {
      view.remove();
    }
  }
  document.querySelectorAll("main img").forEach(function (img) {
    img.addEventListener("click", function () {
      const view = document.createElement("div");
      view.className = "zoom-view";
      view.setAttribute("role", "dialog");
      view.setAttribute("aria-label", img.alt);
      const large = document.createElement("img");
      large.src = img.src;
      large.alt = img.alt;
      view.appendChild(large);
      view.addEventListener("click", close);
      document.body.appendChild(view);
    });
  });
  document.addEventListener("keydown", function (event) {
    if (event.key === "Escape") {
      close();
    }
  });
})();
