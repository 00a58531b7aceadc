/* multihead explain --format html: draws the heat maps from the JSON block; no network. */
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("mh-data").textContent);
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
    return text;
  }

  function showTip(cell, x, y) {
    tip.textContent = describe(cell);
    tip.hidden = false;
    var w = tip.offsetWidth, hgt = tip.offsetHeight;
    tip.style.left = Math.max(4, Math.min(x + 12, window.innerWidth - w - 4)) + "px";
    tip.style.top = Math.max(4, Math.min(y + 12, window.innerHeight - hgt - 4)) + "px";
  }

  var panels = document.querySelector(".panels");
  panels.addEventListener("mouseover", function (e) {
    var cell = e.target.closest(".cell");
    if (cell && cell.dataset.q !== undefined) showTip(cell, e.clientX, e.clientY);
  });
  panels.addEventListener("mousemove", function (e) {
    var cell = e.target.closest(".cell");
    if (cell && cell.dataset.q !== undefined) showTip(cell, e.clientX, e.clientY);
    else tip.hidden = true;
  });
  panels.addEventListener("mouseleave", function () { tip.hidden = true; });
  panels.addEventListener("click", function (e) { // touch screens: tap a cell to read it
    var cell = e.target.closest(".cell");
    if (cell && cell.dataset.q !== undefined) showTip(cell, e.clientX, e.clientY);
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
  document.getElementById("lang-toggle").addEventListener("click", function () {
    state.lang = state.lang === "en" ? "zh" : "en";
    root.dataset.lang = state.lang;
    root.lang = state.lang;
    document.title = ui("title");
    tip.hidden = true;
    render();
  });

  render();
})();
