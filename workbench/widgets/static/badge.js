// Badge view: a small pill showing the model's busy state, its device or its KV memory.
function stateOf(model) {
  if (model.get("kind") === "busy") {
    const warming = String(model.get("warming") || "");
    if (warming) {  // "preparing kernels for this CPU (3/5): ...": show the "3/5"
      const m = warming.match(/\((\d+\/\d+)\)/);
      return { state: "compiling", label: "\u2699 compiling " + (m ? m[1] : ""), title: warming };
    }
    const busy = Boolean(model.get("busy"));
    return { state: busy ? "busy" : "idle", label: busy ? "\u25cf busy" : "\u25cb idle" };
  }
  if (model.get("kind") === "memory") {
    return { state: String(model.get("level") || "ok"), label: String(model.get("label") || ""),
             title: String(model.get("detail") || "") };
  }
  const device = String(model.get("device") || "unknown");
  return { state: device, label: device };
}

function render({ model, el }) {
  const root = document.createElement("span");
  const kind = model.get("kind");
  root.className = `wb-badge wb-${kind}`;
  const paint = () => {
    const { state, label, title } = stateOf(model);
    root.dataset.state = state;
    root.textContent = label;
    root.title = title || (kind === "busy" ? `model is ${state}` : `device: ${state}`);
  };
  paint();
  const events = ["change:busy", "change:device", "change:warming", "change:label",
                  "change:level", "change:detail"];
  for (const event of events) model.on(event, paint);
  el.appendChild(root);
  return () => {
    for (const event of events) model.off(event, paint);
  };
}

export default { render };
