// Badge view: a small pill showing either the model's busy state or its device.
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
  model.on("change:busy", paint);
  model.on("change:device", paint);
  model.on("change:warming", paint);
  el.appendChild(root);
  return () => {
    model.off("change:busy", paint);
    model.off("change:device", paint);
    model.off("change:warming", paint);
  };
}

export default { render };
