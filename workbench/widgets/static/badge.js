// Badge view: a small pill showing either the model's busy state or its device.
function stateOf(model) {
  if (model.get("kind") === "busy") {
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
    const { state, label } = stateOf(model);
    root.dataset.state = state;
    root.textContent = label;
    root.title = kind === "busy" ? `model is ${state}` : `device: ${state}`;
  };
  paint();
  model.on("change:busy", paint);
  model.on("change:device", paint);
  el.appendChild(root);
  return () => {
    model.off("change:busy", paint);
    model.off("change:device", paint);
  };
}

export default { render };
