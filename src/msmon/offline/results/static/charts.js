/* msmon report: the line charts (a heatmap row over steps, the loss), the per-rank outliers and
   the verdict box. report.js hands in its helpers and draws the page with what this returns. */
window.msmonCharts = function (h) {
  "use strict";
  var el = h.el, fmt = h.fmt, showTip = h.showTip, hideTip = h.hideTip, table = h.table, niceStep = h.niceStep;
  var EMPTY = h.codes.EMPTY, ZERO = h.codes.ZERO, NONFINITE = h.codes.NONFINITE;
  var RANK_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                      "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94"];
  var OUTLIER_COLOURS = ["#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"];

  /* A line chart: o.x (numbers), o.lines [{label, colour, values (number, null: a gap, or a
     string: non-finite, marked at the top), width}], o.band {lo, hi} (filled), o.log. */
  function lineChart(o) {
    var W = o.width || 760, H = o.height || 260, L = 64, R = 12, T = 14, B = 30;
    var cv = el("canvas", { width: W, height: H, cls: "line-chart" }), ctx = cv.getContext("2d");
    var ys = [];
    function take(v) { if (typeof v === "number" && (!o.log || v > 0)) ys.push(o.log ? Math.log10(v) : v); }
    o.lines.forEach(function (l) { l.values.forEach(take); });
    if (o.band) { o.band.lo.forEach(take); o.band.hi.forEach(take); }
    var lo = ys.length ? Math.min.apply(null, ys) : 0, hi = ys.length ? Math.max.apply(null, ys) : 1;
    if (hi - lo < (o.log ? 0.5 : 1e-12)) { var mid = (hi + lo) / 2, half = o.log ? 0.25 : Math.max(Math.abs(mid) * 0.05, 1e-6); lo = mid - half; hi = mid + half; }
    var pad = (hi - lo) * 0.06; lo -= pad; hi += pad;
    var x0 = Math.min.apply(null, o.x), x1 = Math.max.apply(null, o.x);
    if (x1 <= x0) { x0 -= 1; x1 += 1; }
    function X(x) { return L + (x - x0) / (x1 - x0) * (W - L - R); }
    function Y(v) { var t = o.log ? Math.log10(v) : v; return T + (1 - (t - lo) / (hi - lo)) * (H - T - B); }
    function finite(v) { return typeof v === "number" && (!o.log || v > 0); }
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
    ctx.strokeStyle = "#e3e7ee"; ctx.fillStyle = "#5b6575"; ctx.font = "10px sans-serif"; ctx.textAlign = "right";
    for (var k = 0; k <= 4; k++) {
      var t = lo + (hi - lo) * k / 4, y = T + (1 - k / 4) * (H - T - B);
      ctx.beginPath(); ctx.moveTo(L, y); ctx.lineTo(W - R, y); ctx.stroke();
      ctx.fillText(fmt(o.log ? Math.pow(10, t) : t), L - 4, y + 3);
    }
    ctx.textAlign = "center";
    var tick = niceStep((x1 - x0) / 10);
    for (var s = Math.ceil(x0 / tick) * tick; s <= x1; s += tick) ctx.fillText(String(Math.round(s * 100) / 100), X(s), H - B + 13);
    ctx.fillText("step", (L + W - R) / 2, H - 4);
    if (o.band) {
      ctx.fillStyle = "rgba(44, 111, 187, 0.16)";
      for (var i = 1; i < o.x.length; i++) {
        var a = [o.band.lo[i - 1], o.band.hi[i - 1], o.band.lo[i], o.band.hi[i]];
        if (!a.every(finite)) continue;
        ctx.beginPath(); ctx.moveTo(X(o.x[i - 1]), Y(a[0])); ctx.lineTo(X(o.x[i - 1]), Y(a[1]));
        ctx.lineTo(X(o.x[i]), Y(a[3])); ctx.lineTo(X(o.x[i]), Y(a[2])); ctx.closePath(); ctx.fill();
      }
    }
    o.lines.forEach(function (l) {
      ctx.strokeStyle = l.colour; ctx.lineWidth = l.width || 1.4; ctx.beginPath();
      var open = false;
      l.values.forEach(function (v, i) {
        if (!finite(v)) { open = false; return; }
        if (open) ctx.lineTo(X(o.x[i]), Y(v)); else ctx.moveTo(X(o.x[i]), Y(v));
        open = true;
      });
      ctx.stroke();
      ctx.fillStyle = l.colour;
      l.values.forEach(function (v, i) {  /* a lone point has no segment: a dot */
        if (finite(v) && !finite(l.values[i - 1]) && !finite(l.values[i + 1])) { ctx.beginPath(); ctx.arc(X(o.x[i]), Y(v), 2, 0, 7); ctx.fill(); }
      });
      ctx.fillStyle = l.colour; ctx.strokeStyle = "#d62728"; ctx.lineWidth = 1.5;
      l.values.forEach(function (v, i) {  /* non-finite: a triangle in the line's colour, outlined red, on the top edge */
        if (typeof v !== "string") return;
        var x = X(o.x[i]); ctx.beginPath(); ctx.moveTo(x - 4, T - 2); ctx.lineTo(x + 4, T - 2); ctx.lineTo(x, T + 6); ctx.closePath();
        ctx.fill(); ctx.stroke();
      });
    });
    ctx.lineWidth = 1;
    cv.addEventListener("mousemove", function (ev) {
      var box = cv.getBoundingClientRect(), mx = ev.clientX - box.left, my = ev.clientY - box.top, best = null, bd = 100;
      o.lines.forEach(function (l) {
        l.values.forEach(function (v, i) {
          if (v === null || v === undefined) return;
          var d = Math.pow(X(o.x[i]) - mx, 2) + Math.pow((finite(v) ? Y(v) : T) - my, 2);
          if (d < bd) { bd = d; best = [l, i, v]; }
        });
      });
      if (best) showTip(ev, best[0].label + " · " + o.xLabel(best[1]) + ": " + (typeof best[2] === "string" ? best[2] : fmt(best[2])));
      else hideTip();
    });
    cv.addEventListener("mouseleave", hideTip);
    return cv;
  }

  function legend(lines, band) {
    return el("div", { cls: "legend" }, (band ? [el("span", null, [el("span", { cls: "sw", style: "background:rgba(44,111,187,0.25)" }), band])] : [])
      .concat(lines.map(function (l) { return el("span", null, [el("span", { cls: "sw", style: "background:" + l.colour }), l.label]); }))
      .concat([el("span", { text: "▼ non-finite (in the line's colour)" })]));
  }

  /* A heatmap row over steps: one line per rank, or the band and the outlier ranks. */
  function rowChart(DATA, map, row) {
    var info = DATA.series, s = map.series, codes = h.decode(s.data), cols = info.columns;
    var x = [], lines = [];
    for (var b = 0; b < cols; b++) x.push(DATA.steps.first_step + b * info.step_width);
    function values(line) {
      var out = [];
      for (var b = 0; b < cols; b++) {
        var code = codes[(row * s.lines + line) * cols + b];
        out.push(code === EMPTY ? null : code === NONFINITE ? "non-finite" : code === ZERO ? 0 : h.valueOf(code, s));
      }
      return out;
    }
    var band = null, bandText = null, what;
    if (info.mode === "lines") {
      info.line_ranks.forEach(function (rank, i) { lines.push({ label: "rank " + rank, colour: RANK_COLOURS[i % RANK_COLOURS.length], values: values(i) }); });
      what = "one line per rank";
    } else {
      band = { lo: values(0), hi: values(2) };
      var top = values(2);
      lines.push({ label: "median of " + info.ranks + " ranks", colour: "#1d2430", values: values(1), width: 2 });
      lines.push({ label: "max (non-finite where any rank was)", colour: "rgba(44,111,187,0.55)", values: top, width: 0.8 });
      (s.outliers[row] || []).forEach(function (rank, j) {
        lines.push({ label: "rank " + rank, colour: OUTLIER_COLOURS[j % OUTLIER_COLOURS.length], values: values(3 + j), width: 1.6 });
      });
      bandText = "min – max over ranks";
      what = "the min–max band of " + info.ranks + " ranks, their median and the " + (s.outliers[row] || []).length +
        " ranks that depart most from it (robust z on " + "the category's first op)";
    }
    var width = info.step_width;
    var cv = lineChart({ x: x, lines: lines, band: band, log: true, width: 820, height: 260,
      xLabel: function (i) { return width > 1 ? "steps " + x[i] + "–" + (x[i] + width - 1) : "step " + x[i]; } });
    return el("div", { cls: "row-chart", "data-row": String(row), "data-lines": String(lines.length), "data-mode": info.mode }, [
      el("b", { text: map.category + " " + map.op + " · " + map.rows[row] + ": largest |" + map.op + "| per rank over steps (log), " + what }),
      cv, legend(lines, bandText)]);
  }

  function lossChart(loss) {
    if (!loss.points) return el("p", { cls: "muted", text: "No loss recorded: \"loss_distribution\": true in the monitor's config records the loss of every micro-step on every rank." });
    var lines = [], band = null, bandText = null;
    if (loss.mode === "lines") {
      loss.lines.forEach(function (l, i) { lines.push({ label: "rank " + l.rank, colour: RANK_COLOURS[i % RANK_COLOURS.length], values: l.values }); });
    } else {
      band = { lo: loss.band.min, hi: loss.band.max };
      lines.push({ label: "median of " + loss.ranks + " ranks", colour: "#1d2430", values: loss.band.median, width: 2 });
      loss.lines.forEach(function (l, j) {
        lines.push({ label: "rank " + l.rank + " (robust z " + (typeof l.z === "string" ? l.z : fmt(l.z)) + ")", colour: OUTLIER_COLOURS[j % OUTLIER_COLOURS.length], values: l.values, width: 1.6 });
      });
      bandText = "min – max over ranks";
    }
    var w = loss.step_width;
    var cv = lineChart({ x: loss.x, lines: lines, band: band, log: false, width: 1100, height: 280,
      xLabel: function (i) {
        if (w) return "steps " + loss.x[i] + "–" + (loss.x[i] + w - 1) + " (mean)";
        var step = Math.floor(loss.x[i] + 1e-9);
        return "step " + step + (loss.micro_steps > 1 ? ", micro-step " + Math.round((loss.x[i] - step) * loss.micro_steps) : "");
      } });
    var what = "The value each backward pass ran on: the script's own scaling included (a loss divided by the " +
      "gradient-accumulation steps reads divided), a loss scaler's (GradScaler, DeepSpeed, Megatron) not. ";
    var note = what + (loss.mode === "lines" ? "One line per rank, a point per micro-step" + (w ? " (here the mean over " + w + " steps)" : "") + "."
      : loss.ranks + " ranks: the band of their min and max, their median, and the " + loss.lines.length +
        " ranks whose loss departs most from the median (robust z: |loss − median| / (1.4826 MAD))" + (w ? "; the mean over " + w + " steps per point" : "") + ".");
    return el("div", { id: "loss-chart", "data-lines": String(lines.length), "data-mode": loss.mode }, [
      el("p", { cls: "muted", text: note }), el("div", { cls: "chart" }, [cv]), legend(lines, bandText)]);
  }

  function outliers(ro) {
    var box = el("div");
    box.appendChild(el("p", { cls: "muted", text: "Activations and unreduced gradients (" + ro.categories.join(", ") +
      ") differ from rank to rank by design: each rank has its own batch. Here, at every step, each rank's " + ro.op +
      " is compared with the ranks' median in robust standard deviations: z = |value − median| / max(" + ro.mad_scale +
      " × MAD, " + ro.mad_floor + " × |median|). Per tensor, the rank and step where z is largest; steps with fewer than " +
      ro.min_ranks + " ranks are left out. " + h.int(ro.tensors) + " tensors on up to " + h.int(ro.max_ranks) + " ranks were compared." }));
    if (!ro.top.length) {
      box.appendChild(el("p", { text: ro.tensors ? "Nothing to compare: fewer than " + ro.min_ranks + " ranks wrote each tensor." : "No rank-local tensors in the database." }));
      return box;
    }
    box.appendChild(table(["category", "tensor", "rank", "step", "micro", ro.op, "median over ranks", "MAD", "ranks", "robust z"],
      ro.top.map(function (t) {
        return [t.category, (t.vpp_stage ? t.vpp_stage + ":" : "") + t.name, String(t.rank), String(t.step),
                t.micro_step === null ? "–" : String(t.micro_step), fmt(t.value), fmt(t.median), fmt(t.mad), String(t.ranks), fmt(t.z)];
      }), [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]));
    return box;
  }

  /* The verdict at the top: the kind of fault in words where analyse tells one, then its text. */
  function verdictBox(a) {
    var parts = [];
    if (a.kind) {
      var k = a.kind, where = ["step " + k.step];
      if (k.rank !== null && k.rank !== undefined) where.push("rank " + k.rank);
      else if (k.code === "some_ranks" && k.ranks && k.ranks.length) where.push("ranks " + k.ranks.join(", "));
      if (k.module) where.push("first module " + k.module);
      parts.push(el("div", { cls: "kind", id: "fault-kind", "data-code": k.code, "data-rank": k.rank === null || k.rank === undefined ? "" : String(k.rank) },
        [el("b", { text: "Kind of fault: " + k.kind }), " (" + where.join(", ") + ")" + (k.action ? ". What to do: " + k.action + "." : "")]));
    }
    parts.push(el("div", null, [el("b", { text: "msmon analyse: " }), a.verdict]));
    return el("div", { cls: "verdict" + (a.total ? "" : " ok"), id: "verdict" }, parts);
  }

  return { lineChart: lineChart, rowChart: rowChart, lossChart: lossChart, outliers: outliers, verdictBox: verdictBox };
};
