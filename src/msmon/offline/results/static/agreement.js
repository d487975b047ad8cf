/* msmon report: the gradient agreement per rank (agreement_chart.py). The signed cos of each rank's
   own gradient with the reduced one on a linear scale (-1 red, 0 white, +1 blue), and its
   norm_ratio on a log scale, a row per rank and a column per step; the rank that dominates the
   reduced gradient named above them, and at the top of the page beside the verdict. */
window.msmonAgreement = function (h, a) {
  "use strict";
  var el = h.el, fmt = h.fmt, box = document.getElementById("agreement");
  if (!a || !a.steps) {
    box.appendChild(el("p", { cls: "muted", text: "No gradient agreement recorded: \"grad_agreement\": true in the monitor's config records " +
      "each rank's cos and norm_ratio against the reduced gradient (docs/loss.md)." }));
    return;
  }
  function signed(c) {  /* -1 #b2182b, 0 #f7f7f7, +1 #2166ac, linear */
    var t = Math.max(-1, Math.min(1, c)), lo = [178, 24, 43], mid = [247, 247, 247], hi = [33, 102, 172];
    var end = t < 0 ? lo : hi, f = Math.abs(t);
    return "rgb(" + [0, 1, 2].map(function (i) { return Math.round(mid[i] + f * (end[i] - mid[i])); }).join(",") + ")";
  }
  var ratios = [];
  a.norm_ratio.forEach(function (row) { row.forEach(function (v) { if (typeof v === "number" && v > 0) ratios.push(Math.log10(v)); }); });
  var rlo = ratios.length ? Math.min.apply(null, ratios) : 0, rhi = ratios.length ? Math.max.apply(null, ratios) : 1;
  if (rhi - rlo < 0.3) { rlo -= 0.15; rhi += 0.15; }
  function ratioColour(v) { return h.colour((Math.log10(v) - rlo) / (rhi - rlo)); }
  function colourOf(op, v) {
    if (v === null || v === undefined) return "#ffffff";
    if (typeof v === "string") return "#d62728";
    if (op === "cos") return signed(v);
    return v > 0 ? ratioColour(v) : "#e4e4e4";
  }
  function stepOf(col) { var s = a.first_step + col * a.step_width; return a.step_width > 1 ? "steps " + s + "–" + (s + a.step_width - 1) : "step " + s; }
  function grid(op) {
    var rows = a.rows.length, cols = a.columns, cw = Math.max(3, Math.min(14, Math.floor(700 / Math.max(1, cols)))), ch = rows > 40 ? 8 : 14;
    var LW = 70, T = 18, cv = el("canvas", { width: LW + cols * cw + 8, height: T + rows * ch + 6, id: "agreement-" + op,
      "data-cell": [LW, T, cw, ch].join(",") });
    var ctx = cv.getContext("2d"), values = a[op];
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, cv.height);
    for (var r = 0; r < rows; r++) for (var c = 0; c < cols; c++) { ctx.fillStyle = colourOf(op, values[r][c]); ctx.fillRect(LW + c * cw, T + r * ch, cw, ch); }
    ctx.fillStyle = "#1d2430"; ctx.textAlign = "right"; ctx.font = (ch >= 14 ? 11 : 8) + "px sans-serif";
    for (var i = 0; i < rows; i++) ctx.fillText("rank " + a.rows[i], LW - 5, T + i * ch + ch - 3);
    ctx.textAlign = "left"; ctx.fillStyle = "#5b6575"; ctx.font = "10px sans-serif";
    ctx.fillText(stepOf(0), LW, 12); ctx.textAlign = "right"; ctx.fillText(stepOf(cols - 1), LW + cols * cw, 12);
    cv.addEventListener("mousemove", function (ev) {
      var b = cv.getBoundingClientRect(), c = Math.floor((ev.clientX - b.left - LW) / cw), r = Math.floor((ev.clientY - b.top - T) / ch);
      if (c < 0 || r < 0 || c >= cols || r >= rows) { h.hideTip(); return; }
      h.showTip(ev, "rank " + a.rows[r] + " · " + stepOf(c) + ": cos " + fmt(a.cos[r][c]) + ", norm_ratio " + fmt(a.norm_ratio[r][c]));
    });
    cv.addEventListener("mouseleave", h.hideTip);
    return cv;
  }
  function legend(op) {
    var cv = el("canvas", { width: 200, height: 12 }), ctx = cv.getContext("2d");
    for (var x = 0; x < 200; x++) { ctx.fillStyle = op === "cos" ? signed(x / 99.5 - 1) : h.colour(x / 199); ctx.fillRect(x, 0, 1, 12); }
    var ends = op === "cos" ? ["cos, linear: −1", "+1 (0 white)"] : ["norm_ratio, log scale: " + fmt(Math.pow(10, rlo)), fmt(Math.pow(10, rhi))];
    return el("div", { cls: "legend" }, [el("span", { text: ends[0] }), cv, el("span", { text: ends[1] }),
      el("span", null, [el("span", { cls: "sw", style: "background:#d62728" }), "non-finite"]),
      el("span", null, [el("span", { cls: "sw", style: "background:#fff" }), "not recorded"])]);
  }
  var d = a.dominant;
  var verdict = d ? el("div", { cls: "verdict", id: "agreement-verdict", "data-rank": String(d.rank), "data-step": String(d.step) },
      [el("b", { text: "Gradient agreement: " }), d.text + (d.steps > 1 ? " (" + d.steps + " steps in all" +
        (d.ranks.length > 1 ? ", ranks " + d.ranks.join(", ") : "") + ")" : "")])
    : el("div", { cls: "verdict ok", id: "agreement-verdict" }, [el("b", { text: "Gradient agreement: " }),
      "no rank's norm_ratio left the others' (threshold " + a.threshold + "), and no rank dominates the reduced gradient."]);
  box.appendChild(verdict);
  var top = document.getElementById("verdict");
  if (d && top) top.appendChild(el("div", { id: "agreement-line" }, [el("b", { text: "Gradient agreement: " }), d.text]));
  box.appendChild(el("p", { cls: "muted", text: "Each rank's own gradient against the reduced one the optimizer steps with: cos (signed) and " +
    "norm_ratio = |own| / |reduced|. Read them together: a rank whose gradient outweighs the others' (its norm_ratio far above theirs) " +
    "makes the reduced gradient its own, so its cos stays high while every other rank's falls. A low cos on healthy ranks says that " +
    "their batches' gradients are mostly noise (small batches, late in training) or that one rank dominates the average, not that " +
    "their data departs. " + a.rows.length + " of " + a.ranks + " ranks" + (a.rows.length < a.ranks ? " (those whose norm_ratio left the others' most)" : "") +
    (a.step_width > 1 ? "; " + a.step_width + " steps averaged per column." : ".") }));
  ["cos", "norm_ratio"].forEach(function (op) {
    box.appendChild(el("h3", { text: op === "cos" ? "cos(own gradient, reduced gradient), signed" : "norm_ratio = |own gradient| / |reduced gradient|" }));
    box.appendChild(el("div", { cls: "chart" }, [grid(op)]));
    box.appendChild(legend(op));
  });
};
