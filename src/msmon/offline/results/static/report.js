/* msmon report: draws the page from the JSON embedded in it. No network, no libraries. */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("msmon-data").textContent);
  var EMPTY = 0, ZERO = 1, NONFINITE = 2, FIRST = 3, LAST = 65535;
  var VIRIDIS = [[68, 1, 84], [71, 45, 123], [59, 82, 139], [44, 114, 142], [33, 145, 140],
                 [40, 174, 128], [94, 201, 98], [173, 220, 48], [253, 231, 37]];
  var PALETTE = ["#d62728", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"];
  var tip = document.getElementById("tip");

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    if (attrs) {
      for (var k in attrs) {
        if (k === "text") node.textContent = attrs[k];
        else if (k === "cls") node.className = attrs[k];
        else node.setAttribute(k, attrs[k]);
      }
    }
    (children || []).forEach(function (c) { if (c) node.appendChild(typeof c === "string" ? document.createTextNode(c) : c); });
    return node;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v === "string") return v;
    if (!isFinite(v)) return String(v);
    var a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e5 || a < 1e-3) return v.toExponential(3);
    return String(Number(v.toPrecision(4)));
  }
  function int(v) { return v === null || v === undefined ? "–" : Number(v).toLocaleString("en-US"); }
  function colour(t) {
    t = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
    var i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i, a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return "rgb(" + Math.round(a[0] + f * (b[0] - a[0])) + "," + Math.round(a[1] + f * (b[1] - a[1])) + "," +
      Math.round(a[2] + f * (b[2] - a[2])) + ")";
  }
  function cellColour(code) {
    if (code === EMPTY) return "#ffffff";
    if (code === ZERO) return "#e4e4e4";
    if (code === NONFINITE) return "#d62728";
    return colour((code - FIRST) / (LAST - FIRST));
  }
  function decode(b64) {
    var bin = atob(b64), bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    var view = new DataView(bytes.buffer), out = new Uint16Array(bytes.length / 2);
    for (var j = 0; j < out.length; j++) out[j] = view.getUint16(2 * j, true);
    return out;
  }
  function valueOf(code, map) {
    if (code < FIRST) return null;
    var span = map.hi - map.lo;
    return Math.pow(10, map.lo + (span > 0 ? (code - FIRST) / (LAST - FIRST) * span : 0));
  }
  function showTip(ev, text) {
    tip.textContent = text;
    tip.style.display = "block";
    var x = ev.clientX + 14, y = ev.clientY + 14;
    if (x + 380 > window.innerWidth) x = ev.clientX - 390;
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function hideTip() { tip.style.display = "none"; }
  function table(headers, rows, numeric) {
    var head = el("tr", null, headers.map(function (h, i) { return el("th", { text: h, cls: numeric && numeric[i] ? "num" : "" }); }));
    var body = rows.map(function (r) {
      return el("tr", null, r.map(function (c, i) {
        return el("td", { text: c, cls: (numeric && numeric[i] ? "num" : "") + (numeric && numeric[i] === "wrap" ? " wrap" : "") });
      }));
    });
    return el("table", null, [el("thead", null, [head]), el("tbody", null, body)]);
  }
  function niceStep(raw) {  /* 1, 2, 5, 10, 20, 50, ... at least raw */
    if (raw <= 1) return 1;
    var p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }
  function stepLabel(col) {
    var s = DATA.steps, a = s.first_step + col * s.step_width, b = a + s.step_width - 1;
    return s.step_width > 1 ? "steps " + a + "–" + b : "step " + a;
  }
  var NO_RANK = 65535;
  var charts = window.msmonCharts({ el: el, fmt: fmt, int: int, showTip: showTip, hideTip: hideTip, table: table, niceStep: niceStep,
    decode: decode, valueOf: valueOf, codes: { EMPTY: EMPTY, ZERO: ZERO, NONFINITE: NONFINITE } });

  /* -- overview ------------------------------------------------------------------------------ */
  function overview() {
    var o = DATA.overview, box = document.getElementById("overview");
    var cost = DATA.cost.stats && DATA.cost.stats.monitor_cost_pct;
    box.appendChild(charts.verdictBox(DATA.anomalies));
    var cards = [["ranks", int(o.ranks)], ["steps", int(o.steps) + (o.steps ? " (" + o.first_step + "–" + o.last_step + ")" : "")],
                 ["tensors", int(o.tensors)], ["values", int(o.values)], ["anomaly records", int(o.anomalies)],
                 ["monitor cost (median)", cost ? fmt(cost.median) + " %" : "–"]];
    box.appendChild(el("div", { cls: "cards" }, cards.map(function (c) {
      return el("div", { cls: "card" }, [el("div", { cls: "v", text: c[1] }), el("div", { cls: "k", text: c[0] })]);
    })));
    var notes = [];
    var s = DATA.steps;
    if (s.step_width > 1) notes.push(o.steps + " recorded steps (" + o.first_step + "–" + o.last_step + ") are shown in " + s.columns +
      " columns of " + s.step_width + " steps each; a cell holds the largest value of its steps.");
    DATA.heatmaps.forEach(function (h) {
      if (h.op === (DATA.heatmaps.filter(function (x) { return x.category === h.category; })[0] || {}).op && h.tensors_per_row > 1)
        notes.push(h.category + ": " + h.tensors + " tensors are shown in " + h.rows.length + " rows of up to " + h.tensors_per_row +
          " neighbouring tensors; a cell holds the largest value of its tensors.");
    });
    if (DATA.anomalies.sampled) notes.push("The anomaly timeline shows " + int(DATA.anomalies.shown) + " of " + int(DATA.anomalies.total) +
      " records: the first " + int(Math.floor(DATA.limits.timeline_points / 2)) + " in training order, then evenly spaced ones.");
    if (DATA.cost.ranks_per_bar > 1) notes.push("The cost chart merges " + DATA.cost.ranks_per_bar + " neighbouring ranks per bar (the costliest is shown).");
    if (DATA.series.step_width > DATA.steps.step_width) notes.push("A heatmap row's chart over steps merges " + DATA.series.step_width +
      " steps per point (the charts of all rows together hold at most " + int(DATA.limits.series_values) + " values).");
    if (o.several_dirs) notes.push(o.several_dirs + " ranks have more than one output directory (" + o.ranks_with_several_dirs.join(", ") +
      (o.several_dirs > o.ranks_with_several_dirs.length ? ", …" : "") + "): several runs are in this database and are shown together.");
    if (notes.length) {
      document.getElementById("notes").appendChild(el("div", { cls: "note" }, [el("b", { text: "Downsampled or merged for a bounded page:" }),
        el("ul", null, notes.map(function (n) { return el("li", { text: n }); }))]));
    }
  }

  /* -- anomalies ----------------------------------------------------------------------------- */
  function anomalies() {
    var a = DATA.anomalies, box = document.getElementById("anomalies");
    if (!a.total) box.appendChild(el("p", { cls: "muted", text: "No anomaly recorded (msmon analyse's verdict is at the top of the page)." }));
    if (a.origin) {
      box.appendChild(el("p", null, [el("b", { text: "First non-finite origin: " }), a.origin.description]));
    }
    if (DATA.first_nonfinite.length) {
      box.appendChild(el("p", { cls: "muted", text: DATA.first_nonfinite.length + " monitor(s) reported a first non-finite origin in summary.json (ranks " +
        DATA.first_nonfinite.slice(0, 12).map(function (f) { return f.rank; }).join(", ") + (DATA.first_nonfinite.length > 12 ? ", …" : "") + ")." }));
    }
    if (!a.total) return;
    var maxRank = 0, minStep = Infinity, maxStep = -Infinity;
    a.points.forEach(function (p) { maxRank = Math.max(maxRank, p[1]); minStep = Math.min(minStep, p[0]); maxStep = Math.max(maxStep, p[0]); });
    var o = DATA.overview;  /* the whole run on the x axis, so one sees when in the run it happened */
    if (o.first_step !== null && o.first_step !== undefined) { minStep = Math.min(minStep, o.first_step); maxStep = Math.max(maxStep, o.last_step + 1); }
    minStep = Math.floor(minStep); maxStep = Math.ceil(maxStep);
    if (maxStep - minStep < 4) { minStep -= 2; maxStep += 2; }
    var W = 1100, H = Math.max(160, Math.min(360, 40 + (maxRank + 1) * 6)), L = 56, R = 16, T = 10, B = 30;
    var cv = el("canvas", { width: W, height: H, id: "timeline" });
    var ctx = cv.getContext("2d");
    function xOf(step) { return L + (step - minStep) / (maxStep - minStep) * (W - L - R); }
    function yOf(rank) { return T + (maxRank > 0 ? rank / maxRank : 0.5) * (H - T - B); }
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
    ctx.strokeStyle = "#d9dee6"; ctx.fillStyle = "#5b6575"; ctx.font = "11px sans-serif";
    ctx.textAlign = "center";
    var stepTick = niceStep((maxStep - minStep) / 12);
    for (var s = Math.ceil(minStep / stepTick) * stepTick; s <= maxStep; s += stepTick) {
      ctx.beginPath(); ctx.moveTo(xOf(s), T); ctx.lineTo(xOf(s), H - B); ctx.stroke();
      ctx.fillText(String(s), xOf(s), H - B + 14);
    }
    ctx.fillText("step", W / 2, H - 3);
    ctx.textAlign = "right";
    var rankTick = niceStep((maxRank + 1) / 10);
    for (var r = 0; r <= maxRank; r += rankTick) ctx.fillText("rank " + r, L - 4, yOf(r) + 4);
    a.points.forEach(function (p) {
      ctx.fillStyle = PALETTE[p[2] % PALETTE.length];
      ctx.beginPath(); ctx.arc(xOf(p[0]), yOf(p[1]), 3, 0, 2 * Math.PI); ctx.fill();
    });
    if (a.origin) {
      ctx.strokeStyle = "#000"; ctx.lineWidth = 2;
      var op = a.points.filter(function (p) { return p[3] === a.origin.seq; })[0];
      if (op) { ctx.beginPath(); ctx.arc(xOf(op[0]), yOf(op[1]), 7, 0, 2 * Math.PI); ctx.stroke(); }
      ctx.lineWidth = 1;
    }
    cv.addEventListener("mousemove", function (ev) {
      var box = cv.getBoundingClientRect(), mx = ev.clientX - box.left, my = ev.clientY - box.top, best = null, bd = 64;
      a.points.forEach(function (p) {
        var d = Math.pow(xOf(p[0]) - mx, 2) + Math.pow(yOf(p[1]) - my, 2);
        if (d < bd) { bd = d; best = p; }
      });
      if (best) {
        showTip(ev, "#" + best[3] + " · rank " + best[1] + " · step " + Math.floor(best[0]) +
          (best[6] === null ? "" : ", micro-step " + best[6]) + " · " + (a.stages[best[5]] || "") + ": " +
          a.tensors[best[4]] + " (" + a.rules[best[2]] + ")");
      } else hideTip();
    });
    cv.addEventListener("mouseleave", hideTip);
    box.appendChild(el("h3", { text: "Timeline across ranks" }));
    box.appendChild(el("div", { cls: "legend" }, a.rules.map(function (rule, i) {
      return el("span", null, [el("span", { cls: "sw", style: "background:" + PALETTE[i % PALETTE.length] }), rule]);
    }).concat(a.origin ? [el("span", { text: "○ first non-finite origin" })] : [])));
    box.appendChild(el("div", { cls: "chart" }, [cv]));
    var details = el("details", { id: "first-anomalies" }, [el("summary", { text: "The first " + a.first.length + " of " + int(a.total) +
      " anomaly records, in training order" })]);
    box.appendChild(details);
    details.appendChild(table(["#", "rank", "step", "micro", "stage", "pp", "vpp", "rule", "category", "tensor", "op", "value", "history"],
      a.first.map(function (e) {
        return [String(e.seq), String(e.rank), String(e.step), e.micro_step === null ? "–" : String(e.micro_step), e.stage,
                String(e.pp_stage), String(e.vpp_stage), e.rule, e.category, e.name, e.op || "–", fmt(e.value), fmt(e.history)];
      }), [1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1]));
  }

  /* -- heatmaps ------------------------------------------------------------------------------ */
  var decoded = 0;
  function drawHeatmap(holder, map, moversBox, chartBox) {
    var codes = decode(map.data), holders = decode(map.ranks);
    var rows = map.rows.length, cols = DATA.steps.columns;
    if (codes.length !== rows * cols) throw new Error("heatmap " + map.category + "/" + map.op + ": " + codes.length + " cells for " + rows + "x" + cols);
    var cw = Math.max(3, Math.min(14, Math.floor(560 / Math.max(1, cols)))), ch = rows > 40 ? 10 : 14, LW = 230, T = 20;
    var cv = el("canvas", { width: LW + cols * cw + 8, height: T + rows * ch + 6 });
    var ctx = cv.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, cv.height);
    for (var r = 0; r < rows; r++) {
      for (var c = 0; c < cols; c++) {
        ctx.fillStyle = cellColour(codes[r * cols + c]);
        ctx.fillRect(LW + c * cw, T + r * ch, cw, ch);
      }
    }
    ctx.font = (ch >= 14 ? 11 : 9) + "px sans-serif"; ctx.fillStyle = "#1d2430"; ctx.textAlign = "right";
    for (var i = 0; i < rows; i++) {
      var label = map.rows[i];
      while (label.length > 4 && ctx.measureText(label).width > LW - 8) label = "…" + label.slice(2);
      ctx.fillText(label, LW - 5, T + i * ch + ch - 3);
    }
    ctx.textAlign = "center"; ctx.fillStyle = "#5b6575"; ctx.font = "10px sans-serif";
    var st = DATA.steps, tick = niceStep(cols * st.step_width / 12);
    for (var s = Math.ceil(st.first_step / tick) * tick; s < st.first_step + cols * st.step_width; s += tick) {
      var k = Math.floor((s - st.first_step) / st.step_width);
      ctx.fillText(String(s), LW + k * cw + cw / 2, 13);
    }
    cv.addEventListener("mousemove", function (ev) {
      var box = cv.getBoundingClientRect(), x = ev.clientX - box.left - LW, y = ev.clientY - box.top - T;
      var c = Math.floor(x / cw), r = Math.floor(y / ch);
      if (x < 0 || y < 0 || c >= cols || r >= rows) { hideTip(); return; }
      var code = codes[r * cols + c], rank = holders[r * cols + c], what;
      var who = rank === NO_RANK ? "" : " on rank " + rank;
      if (code === EMPTY) what = "not recorded";
      else if (code === ZERO) what = "0 (largest |" + map.op + "| over ranks" + (who ? ", first held" + who : "") + ")";
      else if (code === NONFINITE) what = "non-finite" + (who ? who + (rank === NO_RANK ? "" : " (the lowest such rank)") : " on some rank");
      else what = "≈ " + fmt(valueOf(code, map)) + " (largest |" + map.op + "| over ranks" + who + ")";
      showTip(ev, map.rows[r] + " · " + stepLabel(c) + " · " + map.category + " " + map.op + ": " + what + " · click for this row over steps");
    });
    cv.addEventListener("mouseleave", hideTip);
    cv.style.cursor = "pointer";
    cv.addEventListener("click", function (ev) {
      var box = cv.getBoundingClientRect(), r = Math.floor((ev.clientY - box.top - T) / ch);
      if (r < 0 || r >= rows || !map.series) return;
      chartBox.textContent = "";
      chartBox.appendChild(charts.rowChart(DATA, map, r));
      chartBox.setAttribute("data-shown", map.category + "/" + map.op + "/" + r);
    });
    holder.textContent = "";
    holder.appendChild(cv);
    holder.appendChild(legend(map));
    chartBox.textContent = "";
    chartBox.removeAttribute("data-shown");
    moversBox.textContent = "";
    var list = ((DATA.movers[map.category] || {})[map.op]) || [];
    moversBox.appendChild(el("b", { text: "Top movers (" + map.op + "): the largest step-to-step changes of the largest |" + map.op +
      "| over ranks, with the rank that holds it; a turn to or from non-finite first; ▶ marks the first unusual change" +
      " (where a fault began, even when larger changes follow it)" }));
    if (!list.length) moversBox.appendChild(el("p", { cls: "muted", text: "No change between recorded steps (or fewer than two steps)." }));
    else {
      var side = function (value, nonfinite, rank) {  /* wraps before the rank, never inside it */
        return (nonfinite ? nonfinite : fmt(value)) + (rank === null || rank === undefined ? "" : " (rank\u00a0" + rank + ")");
      };
      var t = table(["tensor", "steps", "before (rank)", "after (rank)", "change"], list.map(function (m) {
        var name = ((m.vpp_stage ? m.vpp_stage + ":" : "") + m.name).replace(/\./g, ".\u200b");  /* wraps at its dots */
        return [(m.first_unusual ? "▶ " : "") + name, m.from_step + "\u00a0→\u00a0" + m.step,
                side(m.before, m.before_nonfinite, m.before_rank), side(m.after, m.after_nonfinite, m.after_rank),
                m.factor === null ? (m.after_nonfinite ? "turned non-finite" : "finite again") : (m.factor >= 0 ? "×" + fmt(m.factor) : "÷" + fmt(-m.factor))];
      }), [0, 1, 1, 1, 1]);
      Array.prototype.forEach.call(t.tBodies[0].rows, function (tr, i) {
        tr.className = (list[i].factor === null ? "nonfinite" : "") + (list[i].first_unusual ? " first-unusual" : "");
      });
      moversBox.appendChild(t);
    }
  }
  function legend(map) {
    var cv = el("canvas", { width: 220, height: 12 }), ctx = cv.getContext("2d");
    for (var x = 0; x < 220; x++) { ctx.fillStyle = colour(x / 219); ctx.fillRect(x, 0, 1, 12); }
    var some = map.lo !== null, lo = some ? fmt(Math.pow(10, map.lo)) : "–", hi = some ? fmt(Math.pow(10, map.hi)) : "–";
    return el("div", { cls: "legend" }, [el("span", { text: "|" + map.op + "|, log scale: " + lo }), cv, el("span", { text: hi }),
      el("span", null, [el("span", { cls: "sw", style: "background:#e4e4e4" }), "0"]),
      el("span", null, [el("span", { cls: "sw", style: "background:#d62728" }), "non-finite"]),
      el("span", null, [el("span", { cls: "sw", style: "background:#fff" }), "not recorded"])]);
  }
  function heatmaps() {
    var box = document.getElementById("heatmaps"), byCategory = {};
    DATA.heatmaps.forEach(function (h) { (byCategory[h.category] = byCategory[h.category] || []).push(h); decode(h.data); decoded++; });
    if (!DATA.heatmaps.length) { box.appendChild(el("p", { cls: "muted", text: "No statistics in the database." })); return; }
    DATA.overview.categories.forEach(function (category) {
      var maps = byCategory[category];
      if (!maps) return;
      var holder = el("div"), moversBox = el("div", { cls: "movers" }), buttons = el("div", { cls: "ops" });
      var chartBox = el("div", { cls: "row-chart-box", id: "row-chart-" + category });
      var sectionBox = el("div", { id: "heat-" + category }, [el("h3", { text: category + " (" + maps[0].tensors + " tensors)" }), buttons,
        el("div", { cls: "heat" }, [holder, moversBox]), chartBox]);
      maps.forEach(function (map, i) {
        var b = el("button", { text: map.op, type: "button" });
        b.addEventListener("click", function () {
          Array.prototype.forEach.call(buttons.children, function (x) { x.className = ""; });
          b.className = "on";
          drawHeatmap(holder, map, moversBox, chartBox);
        });
        buttons.appendChild(b);
        if (i === 0) { b.className = "on"; drawHeatmap(holder, map, moversBox, chartBox); }
      });
      box.appendChild(sectionBox);
    });
  }

  /* -- rank spread --------------------------------------------------------------------------- */
  function spread() {
    var s = DATA.spread, box = document.getElementById("spread");
    box.appendChild(el("p", { cls: "muted", text: "Tensors that are the same on every data-parallel rank (" + s.categories.join(", ") +
      "): the same name written by several ranks at the same step should have the same statistics. " + int(s.compared_tensors) +
      " tensors were compared, on up to " + int(s.max_ranks || 0) + " ranks. Under tensor or pipeline parallelism a name can be a " +
      "different shard on each rank, and where msmon writes each replicated tensor once (DeepSpeed, Megatron) there is nothing to compare." }));
    if (!s.top.length) { box.appendChild(el("p", { text: s.compared_tensors ? "No spread: every replicated tensor had the same statistics on every rank." : "Nothing to compare." })); return; }
    Object.keys(s.series).forEach(function (category) {
      var pts = s.series[category], W = 300, H = 70;
      var logs = pts.map(function (p) { return Math.log10(Math.max(p[1], 1e-12)); });
      var lo = Math.min.apply(null, logs), hi = Math.max.apply(null, logs);
      if (hi - lo < 1) { hi = lo + 1; }
      var x0 = pts[0][0], x1 = pts[pts.length - 1][0] || x0 + 1;
      var cv = el("canvas", { width: W, height: H }), ctx = cv.getContext("2d");
      ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
      ctx.strokeStyle = "#2c6fbb"; ctx.beginPath();
      pts.forEach(function (p, i) {
        var x = 4 + (x1 > x0 ? (p[0] - x0) / (x1 - x0) : 0.5) * (W - 8), y = H - 4 - (logs[i] - lo) / (hi - lo) * (H - 8);
        if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      });
      ctx.stroke();
      box.appendChild(el("div", { cls: "spark" }, [el("div", { cls: "t", text: category + ": largest relative spread per step (log, " +
        fmt(Math.pow(10, lo)) + " – " + fmt(Math.pow(10, hi)) + "), steps " + x0 + "–" + x1 }), cv]));
    });
    box.appendChild(table(["category", "op", "tensor", "rel. spread", "max − min", "at step", "min (rank)", "max (rank)", "ranks"],
      s.top.map(function (t) {
        return [t.category, t.op, (t.vpp_stage ? t.vpp_stage + ":" : "") + t.name, fmt(t.rel), fmt(t.spread), String(t.step),
                fmt(t.min) + " (" + t.min_rank + ")", fmt(t.max) + " (" + t.max_rank + ")", String(t.ranks)];
      }), [0, 0, 0, 1, 1, 1, 1, 1, 1]));
  }

  /* -- cost ---------------------------------------------------------------------------------- */
  function cost() {
    var c = DATA.cost, box = document.getElementById("cost");
    if (!c.ranks) { box.appendChild(el("p", { cls: "muted", text: "No summary.json was loaded (the monitors did not close, or the output was copied without it)." })); return; }
    var names = { step_ms: "step time (ms)", monitor_ms_per_step: "monitor on the training thread (ms/step)",
                  monitor_cost_pct: "monitor cost (% of step time)", writer_cpu_ms_per_step: "writer thread CPU (ms/step)" };
    box.appendChild(table(["over " + c.ranks + " ranks", "min", "median", "p90", "max"], Object.keys(names).filter(function (k) { return c.stats[k]; }).map(function (k) {
      var s = c.stats[k];
      return [names[k], fmt(s.min), fmt(s.median), fmt(s.p90), fmt(s.max)];
    }), [0, 1, 1, 1, 1]));
    var W = 1100, H = 150, L = 40, B = 22, T = 8, bars = c.bars, max = 0;
    bars.forEach(function (b) { max = Math.max(max, b[2]); });
    max = max || 1;
    var cv = el("canvas", { width: W, height: H, id: "cost-chart" }), ctx = cv.getContext("2d");
    var bw = (W - L - 8) / bars.length;
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
    ctx.fillStyle = "#5b6575"; ctx.font = "10px sans-serif"; ctx.textAlign = "right";
    ctx.fillText(fmt(max) + " %", L - 3, T + 8); ctx.fillText("0", L - 3, H - B);
    bars.forEach(function (b, i) {
      ctx.fillStyle = "#2c6fbb";
      var h = b[2] / max * (H - T - B);
      ctx.fillRect(L + i * bw, H - B - h, Math.max(1, bw - (bw > 3 ? 1 : 0)), h);
    });
    ctx.textAlign = "center"; ctx.fillStyle = "#5b6575";
    var every = Math.max(1, Math.ceil(bars.length / 16));
    for (var i = 0; i < bars.length; i += every) ctx.fillText(String(bars[i][0]), L + i * bw + bw / 2, H - 8);
    cv.addEventListener("mousemove", function (ev) {
      var box2 = cv.getBoundingClientRect(), i = Math.floor((ev.clientX - box2.left - L) / bw);
      if (i < 0 || i >= bars.length) { hideTip(); return; }
      var b = bars[i];
      showTip(ev, (b[0] === b[1] ? "rank " + b[0] : "ranks " + b[0] + "–" + b[1] + " (costliest: rank " + b[3] + ")") + ": " + fmt(b[2]) + " % of step time");
    });
    cv.addEventListener("mouseleave", hideTip);
    box.appendChild(el("h3", { text: "Monitor cost per rank (% of step time)" }));
    box.appendChild(el("div", { cls: "chart" }, [cv]));
    box.appendChild(el("h3", { text: "The costliest ranks" }));
    box.appendChild(table(["rank", "step ms", "monitor ms/step", "cost %", "writer CPU ms/step", "steps", "alerts"], c.top.map(function (t) {
      return [String(t.rank), fmt(t.step_ms), fmt(t.monitor_ms_per_step), fmt(t.monitor_cost_pct), fmt(t.writer_cpu_ms_per_step),
              int(t.steps_recorded), int(t.alerts)];
    }), [1, 1, 1, 1, 1, 1, 1]));
  }

  function run(name, fn) {
    try { fn(); } catch (e) { window.__msmonError(name + ": " + (e && e.stack ? e.stack : e)); }
  }
  run("overview", overview);
  run("loss", function () { document.getElementById("loss").appendChild(charts.lossChart(DATA.loss)); });
  run("anomalies", anomalies);
  run("agreement", function () { window.msmonAgreement({ el: el, fmt: fmt, showTip: showTip, hideTip: hideTip, colour: colour }, DATA.agreement); });
  run("heatmaps", heatmaps);
  run("outliers", function () { document.getElementById("outliers").appendChild(charts.outliers(DATA.rank_outliers)); });
  run("spread", spread);
  run("cost", cost);
  document.body.setAttribute("data-heatmaps", String(decoded));
  document.body.setAttribute("data-rendered", window.__msmonErrors.length ? "error" : "ok");
})();
