// LensCell: the logit lens as a grid of layers x tokens (hover: the top 5; click: that
// position's distribution at that layer beside the final layer's), and an Attention tab
// (a heatmap per layer and head, and lines from a token to the tokens it attends to).
const MAX_ENTROPY_BITS = 10;
const HOVER_K = 5;

function node(tag, className, text) {
  const n = document.createElement(tag);
  if (className) n.className = className;
  if (text !== undefined) n.textContent = text;
  return n;
}

let svgNamespace = null; // read from the parser, so that no URL is written here

function svg(tag, attrs) {
  if (svgNamespace === null) {
    const holder = document.createElement("div");
    holder.innerHTML = "<svg></svg>";
    svgNamespace = holder.firstChild.namespaceURI;
  }
  const n = document.createElementNS(svgNamespace, tag);
  for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, String(v));
  return n;
}

function visible(text) {
  return (text || "").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5") || "\u2205";
}

function short(text, n = 7) {
  const t = visible(text);
  return t.length <= n ? t : t.slice(0, n - 1) + "\u2026";
}

function fmt(p) {
  return p === null || p === undefined ? "?" : p < 0.001 ? p.toExponential(1) : p.toFixed(3);
}

function cellColor(cell, mode) {
  let good; // 1: confident (green), 0: unsure (red)
  if (mode === "entropy") {
    good = 1 - Math.min(Math.max(cell.h, 0), MAX_ENTROPY_BITS) / MAX_ENTROPY_BITS;
  } else {
    good = Math.min(Math.max(cell.p, 0), 1);
  }
  return `hsl(${Math.round(120 * good)}, 70%, ${Math.round(88 - 14 * good)}%)`;
}

function bars(title, top, highlight) {
  const box = node("div", "wb-lens-dist");
  box.appendChild(node("div", "wb-lens-dist-title", title));
  for (const [text, prob] of top) {
    const row = node("div", "wb-lens-dist-row");
    if (text === highlight) row.classList.add("wb-lens-same");
    const bar = node("span", "wb-lens-dist-bar");
    bar.style.width = `${Math.max(1, Math.round(120 * prob))}px`;
    row.append(node("span", "wb-lens-dist-text", visible(text)), bar,
      node("span", "wb-lens-dist-prob", fmt(prob)));
    box.appendChild(row);
  }
  return box;
}

function render({ model, el }) {
  const root = node("div", "wb-lens");
  const toolbar = node("div", "wb-lens-toolbar");
  const tabs = {};
  for (const [name, label] of [["lens", "Logit lens"], ["attention", "Attention"]]) {
    const b = node("button", "wb-lens-tab", label);
    b.dataset.tab = name;
    b.addEventListener("click", () => { model.set("tab", name); model.save_changes(); });
    tabs[name] = b;
    toolbar.appendChild(b);
  }
  const colorLabel = node("label", "wb-lens-color", "colour by ");
  const colorSelect = node("select");
  for (const mode of ["probability", "entropy"]) {
    const o = node("option", "", mode);
    o.value = mode;
    colorSelect.appendChild(o);
  }
  colorSelect.addEventListener("change", () => {
    model.set("color_by", colorSelect.value);
    model.save_changes();
  });
  colorLabel.appendChild(colorSelect);
  const status = node("span", "wb-lens-status");
  toolbar.append(colorLabel, status);
  const error = node("div", "wb-error");

  // -- the lens panel --
  const lensPanel = node("div", "wb-lens-panel");
  const gridBox = node("div", "wb-lens-gridbox");
  const popup = node("div", "wb-lens-popup");
  popup.hidden = true;
  const detail = node("div", "wb-lens-detail");
  lensPanel.append(gridBox, detail, popup);

  // -- the attention panel --
  const attnPanel = node("div", "wb-attn-panel");
  const attnBar = node("div", "wb-attn-toolbar");
  const layerSelect = node("select", "wb-attn-layer");
  const headSelect = node("select", "wb-attn-head");
  const layerLabel = node("label", "", "layer ");
  layerLabel.appendChild(layerSelect);
  const headLabel = node("label", "", "head ");
  headLabel.appendChild(headSelect);
  const attnInfo = node("span", "wb-attn-info");
  attnBar.append(layerLabel, headLabel, attnInfo);
  const attnViews = node("div", "wb-attn-views");
  const heatBox = node("div", "wb-attn-heatbox");
  const canvas = node("canvas", "wb-attn-heatmap");
  const heatTip = node("div", "wb-attn-tip");
  heatBox.append(canvas, heatTip);
  const linesBox = node("div", "wb-attn-linesbox");
  attnViews.append(heatBox, linesBox);
  attnPanel.append(attnBar, attnViews);

  root.append(toolbar, error, lensPanel, attnPanel);
  el.appendChild(root);

  layerSelect.addEventListener("change", () => {
    model.set("attn_layer", Number(layerSelect.value));
    model.save_changes();
  });
  headSelect.addEventListener("change", () => {
    model.set("attn_head", Number(headSelect.value));
    model.save_changes();
  });

  let pinnedPopup = false;

  const showPopup = (li, pos, anchor) => {
    const layers = model.get("layers") || [];
    const cell = ((model.get("grid") || [])[li] || [])[pos];
    if (!cell) { popup.hidden = true; return; }
    popup.replaceChildren(node("div", "wb-lens-popup-title",
      `layer ${layers[li]}, after ${JSON.stringify(visible((model.get("tokens") || [])[pos]))}` +
      `  H=${cell.h.toFixed(2)} bits`));
    for (const [text, prob] of cell.top.slice(0, HOVER_K)) {
      const row = node("div", "wb-lens-popup-row");
      row.append(node("span", "wb-lens-dist-text", visible(text)),
        node("span", "wb-lens-dist-prob", fmt(prob)));
      popup.appendChild(row);
    }
    popup.style.left = `${anchor.offsetLeft + anchor.offsetWidth + 4}px`;
    popup.style.top = `${anchor.offsetTop}px`;
    popup.hidden = false;
  };

  const paintGrid = () => {
    const grid = model.get("grid") || [];
    const layers = model.get("layers") || [];
    const tokens = model.get("tokens") || [];
    const mode = model.get("color_by");
    const sel = model.get("selected") || [];
    colorSelect.value = mode;
    const table = node("table", "wb-lens-grid");
    for (let li = grid.length - 1; li >= 0; li--) { // the last layer at the top
      const tr = node("tr");
      tr.appendChild(node("th", "wb-lens-layer", String(layers[li])));
      grid[li].forEach((cell, pos) => {
        const td = node("td", "wb-lens-cell", short(cell.t));
        td.dataset.layer = String(layers[li]);
        td.dataset.pos = String(pos);
        td.style.background = cellColor(cell, mode);
        if (sel.length === 2 && sel[0] === layers[li] && sel[1] === pos) {
          td.classList.add("wb-selected");
        }
        td.addEventListener("mouseenter", () => showPopup(li, pos, td));
        td.addEventListener("mouseleave", () => { popup.hidden = true; });
        td.addEventListener("click", (event) => {
          event.stopPropagation();
          model.set("selected", [layers[li], pos]);
          model.save_changes();
        });
        tr.appendChild(td);
      });
      table.appendChild(tr);
    }
    const foot = node("tr", "wb-lens-inputs");
    foot.appendChild(node("th", "wb-lens-layer", "input"));
    tokens.forEach((t, pos) => {
      const th = node("th", "wb-lens-token", short(t));
      th.title = `position ${pos}: ${JSON.stringify(t)}`;
      foot.appendChild(th);
    });
    table.appendChild(foot);
    gridBox.replaceChildren(table);
    if (!grid.length) gridBox.appendChild(node("div", "wb-lens-empty", "nothing traced yet"));
  };

  const paintDetail = () => {
    const sel = model.get("selected") || [];
    const grid = model.get("grid") || [];
    const layers = model.get("layers") || [];
    detail.replaceChildren();
    if (sel.length !== 2 || !grid.length) { detail.hidden = true; return; }
    const li = layers.indexOf(sel[0]);
    const at = (grid[li] || [])[sel[1]];
    const fin = (grid[grid.length - 1] || [])[sel[1]];
    if (!at || !fin) { detail.hidden = true; return; }
    const token = (model.get("tokens") || [])[sel[1]];
    detail.appendChild(node("div", "wb-lens-detail-title",
      `After ${JSON.stringify(visible(token))} (position ${sel[1]})`));
    const pair = node("div", "wb-lens-detail-pair");
    pair.append(bars(`layer ${sel[0]}  (H=${at.h.toFixed(2)} bits)`, at.top, fin.t),
      bars(`final layer ${layers[layers.length - 1]}  (H=${fin.h.toFixed(2)} bits)`,
        fin.top, at.t));
    const close = node("button", "wb-lens-detail-close", "\u00d7");
    close.title = "close";
    close.addEventListener("click", () => { model.set("selected", []); model.save_changes(); });
    detail.append(pair, close);
    detail.hidden = false;
  };

  const weights = () => {
    const dv = model.get("attention_data");
    if (!dv || !dv.byteLength) return null;
    return new Uint8Array(dv.buffer, dv.byteOffset, dv.byteLength);
  };

  const matrixOf = () => { // (T, T) of the chosen layer and head, 0..255, or null
    const data = weights();
    const aLayers = model.get("attention_layers") || [];
    const heads = model.get("heads") || [];
    const T = (model.get("tokens") || []).length;
    const a = aLayers.indexOf(model.get("attn_layer"));
    const h = heads.indexOf(model.get("attn_head"));
    if (!data || a < 0 || h < 0 || !T) return null;
    const start = ((a * heads.length) + h) * T * T;
    return { T, values: data.subarray(start, start + T * T) };
  };

  const paintHeatmap = (m) => {
    const tokens = model.get("tokens") || [];
    const T = m.T;
    const px = Math.max(4, Math.min(18, Math.floor(420 / T)));
    const labels = px >= 9; // token names beside the rows and above the columns
    const left = labels ? 84 : 0;
    const top = labels ? 64 : 0;
    canvas.width = left + T * px;
    canvas.height = top + T * px;
    canvas.style.width = `${canvas.width}px`;
    canvas.style.height = `${canvas.height}px`;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    if (labels) {
      ctx.fillStyle = "#333";
      ctx.font = "11px monospace";
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      for (let i = 0; i < T; i++) ctx.fillText(short(tokens[i], 10), left - 4, top + i * px + px / 2);
      ctx.textAlign = "left";
      for (let j = 0; j < T; j++) {
        ctx.save();
        ctx.translate(left + j * px + px / 2, top - 4);
        ctx.rotate(-Math.PI / 3);
        ctx.fillText(short(tokens[j], 8), 0, 0);
        ctx.restore();
      }
    }
    ctx.strokeStyle = "#ccc";
    ctx.strokeRect(left + 0.5, top + 0.5, T * px - 1, T * px - 1);
    const q = model.get("attn_token");
    for (let i = 0; i < T; i++) {
      for (let j = 0; j <= i; j++) {
        const v = m.values[i * T + j] / 255;
        ctx.fillStyle = `rgba(37, 99, 235, ${v.toFixed(3)})`;
        ctx.fillRect(left + j * px, top + i * px, px, px);
      }
    }
    if (q >= 0 && q < T) {
      ctx.strokeStyle = "#e67700";
      ctx.lineWidth = 2;
      ctx.strokeRect(left + 1, top + q * px + 1, T * px - 2, px - 2);
    }
    const at = (event) => {
      const r = canvas.getBoundingClientRect();
      return [Math.floor((event.clientY - r.top - top) / px),
        Math.floor((event.clientX - r.left - left) / px)];
    };
    canvas.onmousemove = (event) => {
      const [i, j] = at(event);
      if (i < 0 || j < 0 || i >= T || j >= T) { heatTip.textContent = ""; return; }
      heatTip.textContent = `${JSON.stringify(visible(tokens[i]))} \u2192 ` +
        `${JSON.stringify(visible(tokens[j]))}: ${(m.values[i * T + j] / 255).toFixed(3)}`;
    };
    canvas.onmouseleave = () => { heatTip.textContent = ""; };
    canvas.onclick = (event) => {
      const [i] = at(event);
      if (i >= 0 && i < T) { model.set("attn_token", i); model.save_changes(); }
    };
  };

  const paintLines = (m) => {
    const tokens = model.get("tokens") || [];
    const T = m.T;
    const q = Math.min(Math.max(model.get("attn_token"), 0), T - 1);
    const rowH = 18;
    const width = 360;
    const s = svg("svg", { class: "wb-attn-lines", width, height: T * rowH + 24 });
    s.appendChild(svg("text", { x: 4, y: 12, class: "wb-attn-head-label" }))
      .textContent = "token";
    s.appendChild(svg("text", { x: width - 4, y: 12, "text-anchor": "end",
      class: "wb-attn-head-label" })).textContent = "looks at";
    const y = (i) => 24 + i * rowH + rowH / 2;
    for (let j = 0; j < T; j++) {
      const w = m.values[q * T + j] / 255;
      if (w <= 0.004) continue;
      s.appendChild(svg("line", { class: "wb-attn-line", x1: 110, y1: y(q), x2: width - 110,
        y2: y(j), "stroke-width": (0.5 + 9 * w).toFixed(2),
        "stroke-opacity": (0.25 + 0.75 * w).toFixed(2), "data-key": j,
        "data-weight": w.toFixed(3) }));
    }
    for (let i = 0; i < T; i++) {
      const left = svg("text", { x: 104, y: y(i) + 4, "text-anchor": "end",
        class: "wb-attn-token" + (i === q ? " wb-attn-query" : ""), "data-pos": i });
      left.textContent = short(tokens[i], 12);
      left.addEventListener("click", () => { model.set("attn_token", i); model.save_changes(); });
      const right = svg("text", { x: width - 104, y: y(i) + 4,
        class: "wb-attn-token wb-attn-key", "data-pos": i });
      const w = m.values[q * T + i] / 255;
      right.textContent = short(tokens[i], 12) + (i <= q && w > 0.004 ? `  ${w.toFixed(2)}` : "");
      s.append(left, right);
    }
    linesBox.replaceChildren(node("div", "wb-attn-lines-title",
      `Where does ${JSON.stringify(visible(tokens[q]))} look? (click a token to choose)`), s);
  };

  const paintAttention = () => {
    const aLayers = model.get("attention_layers") || [];
    const heads = model.get("heads") || [];
    layerSelect.replaceChildren(...aLayers.map((n) => {
      const o = node("option", "", String(n));
      o.value = String(n);
      return o;
    }));
    headSelect.replaceChildren(...heads.map((h) => {
      const o = node("option", "", String(h));
      o.value = String(h);
      return o;
    }));
    layerSelect.value = String(model.get("attn_layer"));
    headSelect.value = String(model.get("attn_head"));
    const m = matrixOf();
    if (!m) {
      attnInfo.textContent = "no attention recorded (trace with attention=True)";
      canvas.width = 0;
      linesBox.replaceChildren();
      return;
    }
    const group = model.get("kv_group") || 1;
    const win = (model.get("windows") || [])[aLayers.indexOf(model.get("attn_layer"))] || 0;
    attnInfo.textContent = `head ${model.get("attn_head")} reads KV head ` +
      `${Math.floor(model.get("attn_head") / group)}` +
      (group > 1 ? ` (shared by ${group} query heads)` : "") +
      (win ? `; this layer sees the last ${win} positions` : "") +
      "; rows: tokens, columns: the tokens they attend to";
    paintHeatmap(m);
    paintLines(m);
  };

  const paintTab = () => {
    const tab = model.get("tab");
    for (const [name, b] of Object.entries(tabs)) b.classList.toggle("wb-active", name === tab);
    lensPanel.hidden = tab !== "lens";
    attnPanel.hidden = tab !== "attention";
    colorLabel.hidden = tab !== "lens";
  };

  const paintStatus = () => {
    status.textContent = model.get("running") ? "tracing\u2026" : model.get("status");
    error.textContent = model.get("error");
  };

  const unpin = () => { if (pinnedPopup) { pinnedPopup = false; popup.hidden = true; } };
  document.addEventListener("click", unpin);

  const paintAll = () => { paintGrid(); paintDetail(); paintAttention(); paintTab(); paintStatus(); };
  paintAll();
  const listeners = [
    ["change:grid", () => { paintGrid(); paintDetail(); }],
    ["change:color_by", paintGrid],
    ["change:selected", () => { paintGrid(); paintDetail(); }],
    ["change:tab", paintTab],
    ["change:attention_data", paintAttention],
    ["change:attn_layer", paintAttention],
    ["change:attn_head", paintAttention],
    ["change:attn_token", paintAttention],
    ["change:running", paintStatus],
    ["change:status", paintStatus],
    ["change:error", paintStatus],
  ];
  for (const [event, fn] of listeners) model.on(event, fn);
  return () => {
    document.removeEventListener("click", unpin);
    for (const [event, fn] of listeners) model.off(event, fn);
  };
}

export default { render };
