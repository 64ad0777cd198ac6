// TokenView: generated tokens coloured by probability or surprisal, with a
// popup of the top-k alternatives; clicking one asks Python to branch there.
const MAX_SURPRISAL_BITS = 10;

function node(tag, className, text) {
  const n = document.createElement(tag);
  if (className) n.className = className;
  if (text !== undefined) n.textContent = text;
  return n;
}

function colorFor(token, mode) {
  if (token.prob === null || token.prob === undefined) return "transparent";
  let good; // 1 = confident (green), 0 = unlikely (red)
  if (mode === "surprisal") {
    const s = token.surprisal === null ? MAX_SURPRISAL_BITS : token.surprisal;
    good = 1 - Math.min(Math.max(s, 0), MAX_SURPRISAL_BITS) / MAX_SURPRISAL_BITS;
  } else {
    good = Math.min(Math.max(token.prob, 0), 1);
  }
  return `hsl(${Math.round(120 * good)}, 75%, 80%)`;
}

function visible(text) {
  // make whitespace-only tokens visible in the popup
  return text.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5") || "\u2205";
}

function fmt(p) {
  return p === null || p === undefined ? "?" : p < 0.001 ? p.toExponential(1) : p.toFixed(3);
}

function render({ model, el }) {
  const root = node("div", "wb-tokens-root");
  const toolbar = node("div", "wb-tokens-toolbar");
  const modeLabel = node("label", "wb-color-by", "colour by ");
  const select = node("select");
  for (const mode of ["probability", "surprisal"]) {
    const opt = node("option", "", mode);
    opt.value = mode;
    select.appendChild(opt);
  }
  select.addEventListener("change", () => {
    model.set("color_by", select.value);
    model.save_changes();
  });
  modeLabel.appendChild(select);
  const legend = node("span", "wb-legend");
  const status = node("span", "wb-tokens-status");
  toolbar.append(modeLabel, legend, status);

  const text = node("div", "wb-tokens");
  const error = node("div", "wb-error");
  const popup = node("div", "wb-alternatives");
  popup.hidden = true;
  root.append(toolbar, text, error, popup);
  el.appendChild(root);

  let pinned = -1;

  const paintLegend = () => {
    const mode = model.get("color_by");
    select.value = mode;
    legend.replaceChildren();
    const bar = node("span", "wb-legend-bar");
    bar.style.background = "linear-gradient(to right, hsl(0,75%,80%), hsl(60,75%,80%), hsl(120,75%,80%))";
    if (mode === "surprisal") {
      bar.style.background = "linear-gradient(to right, hsl(120,75%,80%), hsl(60,75%,80%), hsl(0,75%,80%))";
      legend.append(node("span", "", "surprisal 0"), bar,
        node("span", "", `\u2265${MAX_SURPRISAL_BITS} bits`));
    } else {
      legend.append(node("span", "", "p = 0"), bar, node("span", "", "1"));
    }
  };

  const showPopup = (index, anchor) => {
    const token = (model.get("tokens") || [])[index];
    if (!token || !anchor) { popup.hidden = true; return; }
    popup.replaceChildren();
    popup.dataset.index = String(index);
    const title = node("div", "wb-alternatives-title",
      `#${index} ${JSON.stringify(token.text)}  p=${fmt(token.prob)}` +
      (token.entropy === null ? "" : `  H=${token.entropy.toFixed(2)} bits`));
    popup.appendChild(title);
    for (const alt of token.top || []) {
      const row = node("div", "wb-alt");
      row.dataset.id = String(alt.id);
      row.dataset.index = String(index);
      row.dataset.chosen = alt.id === token.id ? "true" : "false";
      row.title = "continue from here with this token";
      const bar = node("span", "wb-alt-bar");
      bar.style.width = `${Math.max(1, Math.round(60 * (alt.prob || 0)))}px`;
      row.append(node("span", "wb-alt-text", visible(alt.text)), bar,
        node("span", "wb-alt-prob", fmt(alt.prob)));
      row.addEventListener("click", (event) => {
        event.stopPropagation();
        if (model.get("running")) return;
        model.send({ type: "choose", index, token_id: alt.id });
        pinned = -1;
        popup.hidden = true;
      });
      popup.appendChild(row);
    }
    placePopup(anchor);
    popup.hidden = false;
  };

  // Just below the token's first line box (a token can wrap), in the root's coordinates.
  const placePopup = (anchor) => {
    const box = anchor.getClientRects()[0] || anchor.getBoundingClientRect();
    const origin = root.getBoundingClientRect();
    popup.style.left = `${box.left - origin.left}px`;
    popup.style.top = `${box.bottom - origin.top + 2}px`;
  };
  const spanAt = (index) => text.querySelector(`.wb-token[data-index="${index}"]`);

  const paintTokens = () => {
    const tokens = model.get("tokens") || [];
    const mode = model.get("color_by");
    const selected = model.get("selected");
    text.replaceChildren(node("span", "wb-prompt", model.get("prompt")));
    tokens.forEach((token, i) => {
      const span = node("span", "wb-token", token.text);
      span.dataset.index = String(i);
      span.dataset.id = String(token.id);
      span.style.background = colorFor(token, mode);
      if (token.chosen) span.style.textDecoration = "underline dotted";
      if (i === selected) span.classList.add("wb-selected");
      span.title = `p=${fmt(token.prob)}` +
        (token.surprisal === null ? "" : `, ${token.surprisal.toFixed(2)} bits`);
      span.addEventListener("mouseenter", () => { if (pinned < 0) showPopup(i, span); });
      span.addEventListener("mouseleave", () => { if (pinned < 0) popup.hidden = true; });
      span.addEventListener("click", (event) => {
        event.stopPropagation();
        pinned = i;
        // setting `selected` repaints at once, replacing this span: anchor to the new one
        model.set("selected", i);
        model.save_changes();
        showPopup(i, spanAt(i) || span);
      });
      text.appendChild(span);
    });
    // Every paint replaces the spans: a pinned popup follows its token's new span (and
    // shows its new alternatives, as while streaming); so does a hover popup still shown.
    if (pinned >= tokens.length) { pinned = -1; popup.hidden = true; }
    if (pinned >= 0) showPopup(pinned, spanAt(pinned));
    else if (!popup.hidden) showPopup(Number(popup.dataset.index), spanAt(popup.dataset.index));
    status.textContent = model.get("running") ? "generating\u2026" : `${tokens.length} tokens`;
  };

  const paintError = () => { error.textContent = model.get("error"); };
  const unpin = () => { pinned = -1; popup.hidden = true; };
  document.addEventListener("click", unpin);

  paintLegend();
  paintTokens();
  paintError();
  const onMode = () => { paintLegend(); paintTokens(); };
  const listeners = [
    ["change:color_by", onMode],
    ["change:tokens", paintTokens],
    ["change:prompt", paintTokens],
    ["change:selected", paintTokens],
    ["change:running", paintTokens],
    ["change:error", paintError],
  ];
  for (const [event, fn] of listeners) model.on(event, fn);
  return () => {
    document.removeEventListener("click", unpin);
    for (const [event, fn] of listeners) model.off(event, fn);
  };
}

export default { render };
