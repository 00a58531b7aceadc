/* multihead explain --format html: draws the heat maps from the JSON block; no network. */
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("mh-data").textContent);

  /* A compact map (a lighter page): weights as one byte each (w / 255), the mask as bits. */
  function unpack(b64, shape, bits) {
    var s = atob(b64), out = [], n = 0;
    for (var h = 0; h < shape[0]; h++) {
      var rows = [];
      for (var i = 0; i < shape[1]; i++) {
        var row = new Array(shape[2]);
        for (var j = 0; j < shape[2]; j++, n++) {
          row[j] = bits ? (s.charCodeAt(n >> 3) >> (7 - (n & 7))) & 1 : s.charCodeAt(n) / 255;
        }
        rows.push(row);
      }
      out.push(rows);
    }
    return out;
  }
  data.maps.forEach(function (m) {
    if (m.w8) { m.weights = unpack(m.w8, m.shape, false); m.approx = true; }
    if (m.k8) m.keep = unpack(m.k8, m.shape, true);
  });
  var root = document.documentElement;
  var state = { batch: data.start, head: data.head, lang: data.lang };
  var tip = document.getElementById("tip");
  var VALUES_UP_TO = 10; // print numbers in the cells when there are at most this many keys

  function ui(key) { return data.ui[state.lang][key]; }

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text; // text only: tokens are never parsed as HTML
    return e;
  }

  function labels(tokens, n) {
    var out = [];
    for (var i = 0; i < n; i++) out.push(tokens ? tokens[i] : String(i));
    return out;
  }

  function mix(a, b, t) {
    return "rgb(" + [0, 1, 2].map(function (i) { return Math.round(a[i] + (b[i] - a[i]) * t); }).join(",") + ")";
  }
  var WHITE = [247, 251, 255], BLUE = [8, 48, 107], RED = [165, 15, 21], GREEN = [46, 125, 79], GREY = [225, 228, 232];

  var KINDS = {
    weights: {
      color: function (v) { return mix(WHITE, BLUE, Math.max(0, Math.min(1, v))); },
      dark: function (v) { return v > 0.55; },
      cell: function (v) { return v.toFixed(2); },
      read: function (v) { return v.toPrecision(4); }
    },
    scores: {
      color: function (v, m) { var t = m > 0 ? v / m : 0; return t >= 0 ? mix(WHITE, RED, t) : mix(WHITE, BLUE, -t); },
      dark: function (v, m) { return m > 0 && Math.abs(v / m) > 0.6; },
      cell: function (v) { return v.toFixed(1); },
      read: function (v) { return v.toPrecision(4); }
    },
    mask: {
      color: function (v) { return v ? mix(WHITE, GREEN, 0.75) : mix(WHITE, GREY, 1); },
      dark: function (v) { return v === 1; },
      cell: function (v) { return String(v); },
      read: function (v) { return String(v); }
    }
  };

  function current() { return data.maps[state.batch]; }

  /* ---- one score worked out by hand: q_i . k_j = sum_d q_id k_jd, then scaled */
  var TERMS_UP_TO = 6; // every product when D is at most this; else the first four, an ellipsis, the last
  var SUB = "\u2080\u2081\u2082\u2083\u2084\u2085\u2086\u2087\u2088\u2089";
  function sub(n) { return String(n).split("").map(function (c) { return SUB[Number(c)]; }).join(""); }
  function num(v) { return (v < 0 ? "\u2212" : "") + Math.abs(v).toFixed(4); }
  var worked = { q: null, k: null };

  function showWorked(map, h, i, j) {
    var box = document.getElementById("worked");
    if (!box) return;
    if (!map.q || !map.k || map.scale === null || !map.scores) { box.hidden = true; return; }
    // the JSON holds the shortest decimals of float32 values: fround gives back the float32 itself
    var kvHead = Math.floor(h / (map.q.length / map.k.length)); // grouped-query attention: h // g
    var q = map.q[h][i].map(Math.fround), k = map.k[kvHead][j].map(Math.fround), D = q.length, sum = 0;
    for (var d = 0; d < D; d++) sum += q[d] * k[d];
    var shown = [];
    for (d = 0; d < D; d++) if (D <= TERMS_UP_TO || d < 4 || d === D - 1) shown.push(d);
    var terms = [];
    shown.forEach(function (d, n) {
      if (n > 0 && d !== shown[n - 1] + 1) terms.push("\u2026");
      terms.push("(" + num(q[d]) + ")(" + num(k[d]) + ")");
    });
    var scaled = sum * map.scale, ij = sub(i) + "," + sub(j);
    var lines = [
      ui("head") + " " + h + ", " + ui("query") + " " + i + labelOf(map.q_tokens, i) + ", " + ui("key") + " " + j + labelOf(map.k_tokens, j),
      "q" + sub(i) + " \u00b7 k" + sub(j) + " = \u03a3_d q" + sub(i) + "[d] k" + sub(j) + "[d]   (d = 0 \u2026 " + (D - 1) + ")",
      "  = " + terms.join(" + "),
      "  = " + num(sum) + "   (" + ui("worked_sum").replace("{D}", String(D)) + ")",
      "s" + ij + " = " + num(sum) + " \u00d7 " + map.scale.toPrecision(4) + " = " + num(scaled) + "   (" + ui("worked_scaled") + ")"
    ];
    if (map.softcap) { // s -> cap tanh(s / cap), after the scale, before the mask
      var capped = map.softcap * Math.tanh(scaled / map.softcap);
      lines.push("  \u2192 " + map.softcap + "\u00b7tanh(s / " + map.softcap + ") = " + num(capped) + "   (" + ui("worked_softcap") + ")");
      scaled = capped;
    }
    if (map.keep && !map.keep[h][i][j]) lines.push(ui("mask") + ": " + ui("blocked") + " \u2192 \u2212\u221e");
    if (map.sink) lines.push(ui("worked_sink").replace("{logit}", map.sink[h].toFixed(4)));
    document.getElementById("worked-text").textContent = lines.join("\n");
    box.dataset.head = String(h); box.dataset.q = String(i); box.dataset.k = String(j);
    box.dataset.sum = String(sum); box.dataset.scaled = String(scaled); box.dataset.terms = String(D);
    box.hidden = false;
    worked.q = i; worked.k = j;
    Array.prototype.forEach.call(document.querySelectorAll("#heat-scores .cell.active"), function (c) { c.classList.remove("active"); });
    var cell = document.querySelector('#heat-scores .cell[data-q="' + i + '"][data-k="' + j + '"]');
    if (cell) cell.classList.add("active");
  }

  function labelOf(tokens, i) { return tokens ? " \u201c" + tokens[i] + "\u201d" : ""; }

  /* ---- every layer x head as a thumbnail (maps grouped by layer) */
  function paint(canvas, m) {
    var Lq = m.length, Lk = Lq ? m[0].length : 0;
    canvas.width = Lk; canvas.height = Lq;
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(Lk, Lq);
    for (var i = 0; i < Lq; i++) for (var j = 0; j < Lk; j++) {
      var t = Math.max(0, Math.min(1, m[i][j] === null ? 0 : m[i][j])), p = 4 * (i * Lk + j);
      for (var c = 0; c < 3; c++) img.data[p + c] = Math.round(WHITE[c] + (BLUE[c] - WHITE[c]) * t);
      img.data[p + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }

  function buildModelView() {
    var grid = document.getElementById("mv-grid");
    if (!grid) return;
    var H = 0;
    data.maps.forEach(function (m) { H = Math.max(H, m.weights.length); });
    grid.style.gridTemplateColumns = "max-content repeat(" + H + ", minmax(20px, 64px))";
    grid.appendChild(el("div", "mv-corner"));
    for (var h = 0; h < H; h++) grid.appendChild(el("div", "mv-col", String(h)));
    data.maps.forEach(function (m, l) {
      grid.appendChild(el("div", "mv-row", ui("layer") + " " + l));
      m.weights.forEach(function (w, h) {
        var t = el("div", "mv-thumb");
        t.dataset.layer = String(l); t.dataset.head = String(h);
        t.title = ui("layer") + " " + l + ", " + ui("head") + " " + h + (headLabel(m, h) ? " \u00b7 " + headLabel(m, h) : "");
        var c = document.createElement("canvas");
        paint(c, w);
        t.appendChild(c);
        grid.appendChild(t);
      });
    });
    grid.addEventListener("click", function (e) {
      var t = e.target.closest(".mv-thumb");
      if (!t) return;
      state.batch = Number(t.dataset.layer);
      state.head = Number(t.dataset.head);
      render();
      document.getElementById("attention").scrollIntoView({ block: "start" });
    });
  }

  function markModelView() {
    Array.prototype.forEach.call(document.querySelectorAll(".mv-thumb"), function (t) {
      var on = Number(t.dataset.layer) === state.batch && Number(t.dataset.head) === state.head;
      t.classList.toggle("selected", on);
    });
    Array.prototype.forEach.call(document.querySelectorAll(".mv-row"), function (r, l) { r.textContent = ui("layer") + " " + l; });
  }

  /* The short label of head h (a pattern it shows), in the page's language, or "". */
  function headLabel(map, h) {
    if (!map.head_labels) return "";
    return (map.head_labels[state.lang] || map.head_labels.en)[h];
  }

  function matrixOf(kind, map, h) {
    if (kind === "weights") return map.weights[h];
    if (kind === "scores") return map.scores ? map.scores[h] : null;
    if (map.keep) return map.keep[h];
    return map.weights[h].map(function (row) { return row.map(function () { return 1; }); });
  }

  function maxAbs(m) {
    var best = 0;
    m.forEach(function (row) { row.forEach(function (v) { if (v !== null) best = Math.max(best, Math.abs(v)); }); });
    return best;
  }

  /* One heat map as a CSS grid of cells; with `full`, token labels, values and hover data. */
  function heat(kind, map, h, full) {
    var m = matrixOf(kind, map, h), spec = KINDS[kind];
    var Lq = m.length, Lk = Lq ? m[0].length : 0, scale = kind === "scores" ? maxAbs(m) : 1;
    var keep = map.keep ? map.keep[h] : null;
    var q = labels(map.q_tokens, Lq), k = labels(map.k_tokens, Lk);
    var g = el("div", "hm");
    g.dataset.kind = kind;
    g.dataset.head = String(h);
    g.style.gridTemplateColumns = (full ? "max-content " : "") + "repeat(" + Lk + (full ? ", minmax(18px, 44px))" : ", minmax(0, 1fr))");
    if (full) {
      g.appendChild(el("div", "tok corner"));
      k.forEach(function (t) { g.appendChild(el("div", "tok col", t)); });
    }
    for (var i = 0; i < Lq; i++) {
      if (full) g.appendChild(el("div", "tok row", q[i]));
      for (var j = 0; j < Lk; j++) {
        var v = m[i][j], c = el("div", "cell"); // v is null where the source had no finite value (-inf)
        c.style.background = v === null ? mix(WHITE, GREY, 1) : spec.color(v, scale);
        if (v === null || (keep && !keep[i][j] && kind !== "mask")) c.classList.add("blocked");
        if (full) {
          if (v !== null) c.dataset.v = String(v);
          c.dataset.q = String(i);
          c.dataset.k = String(j);
          if (Lk <= VALUES_UP_TO) {
            c.textContent = v === null ? "\u2212\u221e" : spec.cell(v);
            c.style.color = v !== null && spec.dark(v, scale) ? "#fff" : "#1d232b";
          }
        }
        g.appendChild(c);
      }
    }
    return g;
  }

  function put(id, node) {
    var box = document.getElementById(id);
    box.textContent = "";
    box.appendChild(node);
  }

  function render() {
    var map = current(), h = state.head;
    document.getElementById("map-title").textContent = map.title;
    document.getElementById("panel-scores").hidden = !map.scores;
    document.getElementById("no-scores").hidden = !!map.scores;
    put("heat-scores", map.scores ? heat("scores", map, h, true) : el("div"));
    document.getElementById("panel-mask").hidden = !map.keep; // a source without a mask: nothing to show
    put("heat-mask", map.keep ? heat("mask", map, h, true) : el("div"));
    put("heat-weights", heat("weights", map, h, true));
    var heads = document.getElementById("all-heads");
    heads.textContent = "";
    map.weights.forEach(function (_, i) {
      var t = el("div", "thumb" + (i === h ? " selected" : ""));
      t.dataset.head = String(i);
      var label = headLabel(map, i);
      t.appendChild(el("div", "cap", ui("head") + " " + i + (label ? " \u00b7 " + label : "")));
      t.appendChild(heat("weights", map, i, false));
      heads.appendChild(t);
    });
    document.getElementById("head-select").value = String(h);
    document.getElementById("batch-select").value = String(state.batch);
    document.getElementById("head-label").textContent = headLabel(map, h);
    var Lq = map.weights[h].length;
    var wi = worked.q !== null && worked.q < Lq ? worked.q : Lq - 1;
    var wj = worked.k !== null && worked.k < map.weights[h][0].length ? worked.k : 0;
    showWorked(map, h, wi, wj);
    markModelView();
  }

  function describe(cell) {
    var map = current(), grid = cell.parentNode, kind = grid.dataset.kind;
    var i = Number(cell.dataset.q), j = Number(cell.dataset.k);
    var v = cell.dataset.v === undefined ? "\u2212\u221e" : KINDS[kind].read(Number(cell.dataset.v));
    var q = labels(map.q_tokens, map.weights[0].length)[i];
    var k = labels(map.k_tokens, map.weights[0][0].length)[j];
    var text = ui("head") + " " + grid.dataset.head + "\n" +
      ui("query") + " " + i + (map.q_tokens ? " \u201c" + q + "\u201d" : "") + " \u2192 " +
      ui("key") + " " + j + (map.k_tokens ? " \u201c" + k + "\u201d" : "") + "\n" +
      ui("short_" + kind) + ": " + v;
    if (cell.classList.contains("blocked")) text += " (" + ui("blocked") + ")";
    else if (kind === "weights" && map.approx) text += " (" + ui("approx") + ")";
    return text;
  }

  function showTip(cell, x, y) {
    tip.textContent = describe(cell);
    tip.hidden = false;
    var w = tip.offsetWidth, hgt = tip.offsetHeight;
    tip.style.left = Math.max(4, Math.min(x + 12, window.innerWidth - w - 4)) + "px";
    tip.style.top = Math.max(4, Math.min(y + 12, window.innerHeight - hgt - 4)) + "px";
  }

  document.getElementById("lang-toggle").addEventListener("click", function () {
    state.lang = state.lang === "en" ? "zh" : "en";
    root.dataset.lang = state.lang;
    root.lang = state.lang;
    document.title = ui("title");
    tip.hidden = true;
    if (data.maps.length) render();
  });

  if (!data.maps.length) return; // a fused trace: the steps and checks only, nothing to draw

  function onScores(cell) {
    if (cell.parentNode.dataset.kind !== "scores") return;
    showWorked(current(), state.head, Number(cell.dataset.q), Number(cell.dataset.k));
  }

  var panels = document.querySelector(".panels");
  panels.addEventListener("mouseover", function (e) {
    var cell = e.target.closest(".cell");
    if (cell && cell.dataset.q !== undefined) { showTip(cell, e.clientX, e.clientY); onScores(cell); }
  });
  panels.addEventListener("mousemove", function (e) {
    var cell = e.target.closest(".cell");
    if (cell && cell.dataset.q !== undefined) showTip(cell, e.clientX, e.clientY);
    else tip.hidden = true;
  });
  panels.addEventListener("mouseleave", function () { tip.hidden = true; });
  panels.addEventListener("click", function (e) { // touch screens: tap a cell to read it
    var cell = e.target.closest(".cell");
    if (cell && cell.dataset.q !== undefined) { showTip(cell, e.clientX, e.clientY); onScores(cell); }
  });
  window.addEventListener("scroll", function () { tip.hidden = true; }, { passive: true });

  document.getElementById("head-select").addEventListener("change", function (e) {
    state.head = Number(e.target.value);
    render();
  });
  document.getElementById("batch-select").addEventListener("change", function (e) {
    state.batch = Number(e.target.value);
    render();
  });
  document.getElementById("all-heads").addEventListener("click", function (e) {
    var t = e.target.closest(".thumb");
    if (!t) return;
    state.head = Number(t.dataset.head);
    render();
  });

  buildModelView();
  render();
})();
