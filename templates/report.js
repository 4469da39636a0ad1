// Saved-tensor table and copy buttons. Rows come from the embedded JSON and are written with
// textContent only, so module names stay text; one page of rows at a time keeps big reports fast.
(function () {
  "use strict";
  var PAGE = 100;
  var data = JSON.parse(document.getElementById("gradaudit-data").textContent);
  var col = {};
  data.columns.forEach(function (name, i) { col[name] = i; });
  var rows = data.rows;
  var shown = rows;
  var sortKey = "index", sortDir = 1, page = 0;
  var tbody = document.querySelector("#tensor-table tbody");
  var filter = document.getElementById("filter");
  var verdict = document.getElementById("verdict");

  function human(n) {
    if (n === null || n === undefined) { return "?"; }
    var units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"], u = 0, v = Math.abs(n);
    while (v >= 1024 && u < units.length - 1) { v /= 1024; u++; }
    if (u === 0) { return (n < 0 ? "-" : "") + v + " B"; }
    var figure = v.toFixed(v < 10 ? 2 : v < 100 ? 1 : 0);
    if (figure.indexOf(".") >= 0) { figure = figure.replace(/0+$/, "").replace(/\.$/, ""); }
    return (n < 0 ? "-" : "") + figure + " " + units[u];
  }

  function haystack(r) {
    return [r[col.module], r[col.module_class], r[col.node], r[col.attr], r[col.rule] || "",
            r[col.source] || "unknown", r[col.storage_kind], r[col.reason]].join(" ").toLowerCase();
  }

  function apply() {
    var text = filter.value.trim().toLowerCase();
    var want = verdict.value;
    shown = rows.filter(function (r) {
      return (!want || r[col.verdict] === want) && (!text || haystack(r).indexOf(text) >= 0);
    });
    var i = col[sortKey];
    shown.sort(function (a, b) {
      var x = a[i], y = b[i];
      if (x === y) { return a[0] - b[0]; }
      if (x === null || x === undefined) { return 1; }
      if (y === null || y === undefined) { return -1; }
      return (x < y ? -1 : 1) * sortDir;
    });
    page = 0;
    draw();
  }

  function cell(tr, text, cls, title) {
    var td = document.createElement("td");
    td.textContent = text;
    if (cls) { td.className = cls; }
    if (title) { td.title = title; }
    tr.appendChild(td);
  }

  function draw() {
    var pages = Math.max(1, Math.ceil(shown.length / PAGE));
    page = Math.min(Math.max(page, 0), pages - 1);
    var frag = document.createDocumentFragment();
    shown.slice(page * PAGE, (page + 1) * PAGE).forEach(function (r) {
      var tr = document.createElement("tr");
      var packed = r[col.bitpackable] && r[col.verdict] !== "sign-only" ? " (1 bit would do)" : "";
      var bytes = human(r[col.view_bytes]);
      if (r[col.storage_bytes] !== null && r[col.storage_bytes] !== r[col.view_bytes]) {
        bytes += " of " + human(r[col.storage_bytes]);
      }
      cell(tr, r[col.index], "num");
      cell(tr, r[col.module] || "(model)", null, r[col.module_class]);
      cell(tr, r[col.node]);
      cell(tr, r[col.attr]);
      cell(tr, r[col.shape] || "scalar");
      cell(tr, r[col.dtype]);
      cell(tr, bytes, "num");
      cell(tr, r[col.storage_kind] + (r[col.managed_by] !== "autograd" ? " / " + r[col.managed_by] : ""));
      cell(tr, r[col.verdict] + packed, "v-" + r[col.verdict], r[col.reason]);
      cell(tr, r[col.rule] || "");
      cell(tr, r[col.source] || "unknown", "src");
      frag.appendChild(tr);
    });
    tbody.textContent = "";
    tbody.appendChild(frag);
    document.getElementById("count").textContent = shown.length + " of " + rows.length + " saved tensors";
    document.getElementById("page").textContent = "page " + (page + 1) + " of " + pages;
    document.getElementById("prev").disabled = page === 0;
    document.getElementById("next").disabled = page >= pages - 1;
  }

  document.querySelectorAll("#tensor-table th[data-key]").forEach(function (th) {
    th.addEventListener("click", function () {
      var key = th.getAttribute("data-key");
      sortDir = key === sortKey ? -sortDir : (key === "view_bytes" ? -1 : 1);
      sortKey = key;
      document.querySelectorAll("#tensor-table th").forEach(function (h) { h.classList.remove("asc", "desc"); });
      th.classList.add(sortDir > 0 ? "asc" : "desc");
      apply();
    });
  });
  var timer = null;
  filter.addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(apply, 120); });
  verdict.addEventListener("change", apply);
  document.getElementById("prev").addEventListener("click", function () { page--; draw(); });
  document.getElementById("next").addEventListener("click", function () { page++; draw(); });

  // Copy buttons: the clipboard API is refused on some file:// pages; then select the text instead.
  document.querySelectorAll("button.copy").forEach(function (button) {
    button.addEventListener("click", function () {
      var code = button.parentNode.querySelector("code");
      function selectIt() {
        var range = document.createRange();
        range.selectNodeContents(code);
        var selection = window.getSelection();
        selection.removeAllRanges();
        selection.addRange(range);
        button.textContent = "Press Ctrl+C";
      }
      try {
        navigator.clipboard.writeText(code.textContent).then(function () { button.textContent = "Copied"; }, selectIt);
      } catch (e) {
        selectIt();
      }
    });
  });

  // A wide graph opens scrolled to its first op (the top of the forward), not to an empty corner.
  Array.prototype.forEach.call(document.querySelectorAll(".graph"), function (panel) {
    var top = null;
    Array.prototype.forEach.call(panel.querySelectorAll("svg g.node"), function (node) {
      var r = node.getBoundingClientRect();
      if (r.width > 0 && (top === null || r.top < top.top - 1)) { top = r; }
    });
    if (top === null) { return; }
    var box = panel.getBoundingClientRect();
    panel.scrollLeft = Math.max(0, top.left - box.left + panel.scrollLeft - (panel.clientWidth - top.width) / 2);
    panel.scrollTop = 0;
  });

  apply();
}());
