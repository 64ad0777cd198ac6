// ChatCell view. Messages arrive already rendered to safe HTML by Python
// (markdown-it with raw HTML disabled); actions go back as custom messages.
function el(tag, className, attrs = {}) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function slider(model, name, label, min, max, step) {
  const wrap = el("label", `wb-chat-${name.replace("_", "-")}`);
  wrap.append(label + " ");
  const input = el("input", "", { type: "range", min, max, step });
  const shown = el("span", "wb-chat-value");
  const sync = () => {
    input.value = model.get(name);
    shown.textContent = Number(model.get(name)).toFixed(2);
  };
  input.addEventListener("input", () => {
    model.set(name, Number(input.value));
    model.save_changes();
    shown.textContent = Number(input.value).toFixed(2);
  });
  sync();
  model.on(`change:${name}`, sync);
  wrap.append(input, shown);
  return wrap;
}

function render({ model, el: host }) {
  const root = el("div", "wb-chat");

  const header = el("div", "wb-chat-header");
  const badge = el("span", "wb-badge wb-busy");
  const maxWrap = el("label", "wb-chat-max-tokens");
  maxWrap.append("max tokens ");
  const maxInput = el("input", "", { type: "number", min: 1, step: 1 });
  maxInput.value = model.get("max_tokens");
  maxInput.addEventListener("change", () => {
    const n = Math.max(1, Math.round(Number(maxInput.value) || 1));
    model.set("max_tokens", n);
    model.save_changes();
  });
  model.on("change:max_tokens", () => { maxInput.value = model.get("max_tokens"); });
  maxWrap.append(maxInput);
  header.append(
    badge,
    slider(model, "temperature", "temperature", 0, 2, 0.05),
    slider(model, "top_p", "top-p", 0, 1, 0.01),
    maxWrap,
  );

  const system = el("textarea", "wb-chat-system", { rows: 1, placeholder: "System prompt" });
  system.value = model.get("system");
  system.addEventListener("input", () => {
    model.set("system", system.value);
    model.save_changes();
  });
  model.on("change:system", () => {
    if (system.value !== model.get("system")) system.value = model.get("system");
  });

  const log = el("div", "wb-chat-log");
  const error = el("div", "wb-error", { role: "alert" });
  const input = el("textarea", "wb-chat-input", {
    rows: 3, placeholder: "Message (Enter to send, Shift+Enter for a new line)",
  });
  const buttons = el("div", "wb-chat-buttons");
  const make = (cls, text) => {
    const b = el("button", cls, { type: "button" });
    b.textContent = text;
    return b;
  };
  const send = make("wb-chat-send", "Send");
  const stop = make("wb-chat-stop", "Stop");
  const regenerate = make("wb-chat-regenerate", "Regenerate");
  const carryOn = make("wb-chat-continue", "Continue");
  carryOn.title = "the answer was cut at max tokens: carry on writing it";
  const clear = make("wb-chat-clear", "Clear");
  const stats = el("span", "wb-chat-stats");
  buttons.append(send, stop, regenerate, carryOn, clear, stats);

  root.append(header, system, log, error, input, buttons);
  host.appendChild(root);

  const doSend = () => {
    const text = input.value.trim();
    if (!text || model.get("generating")) return;
    model.send({ type: "send", text });
    input.value = "";
  };
  send.addEventListener("click", doSend);
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      doSend();
    }
  });
  stop.addEventListener("click", () => model.send({ type: "stop" }));
  regenerate.addEventListener("click", () => model.send({ type: "regenerate" }));
  carryOn.addEventListener("click", () => model.send({ type: "continue" }));
  clear.addEventListener("click", () => model.send({ type: "clear" }));

  const paintLog = () => {
    const messages = model.get("log") || [];
    const nearBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
    while (log.children.length > messages.length) log.lastChild.remove();
    messages.forEach((message, i) => {
      let node = log.children[i];
      if (!node) {
        node = el("div", "");
        log.appendChild(node);
      }
      const cls = `wb-msg wb-msg-${message.role}`;
      if (node.className !== cls) node.className = cls;
      node.dataset.role = message.role;
      node.dataset.streaming = message.streaming ? "true" : "false";
      if (node.wbHtml !== message.html) {
        node.innerHTML = message.html; // produced by Python with raw HTML escaped
        node.wbHtml = message.html;
      }
    });
    if (nearBottom) log.scrollTop = log.scrollHeight;
  };
  const paintState = () => {
    const generating = Boolean(model.get("generating"));
    const busy = Boolean(model.get("busy"));
    const warming = String(model.get("warming") || "");  // "... (2/4): ..." or ""
    const step = warming.match(/\((\d+\/\d+)\)/);
    badge.dataset.state = warming ? "compiling" : busy ? "busy" : "idle";
    badge.textContent = warming ? "\u2699 compiling " + (step ? step[1] : "")
      : busy ? "\u25cf busy" : "\u25cb idle";
    badge.title = warming;
    root.dataset.generating = generating ? "true" : "false";
    send.disabled = generating;
    regenerate.disabled = generating;
    stop.disabled = !generating;
    carryOn.hidden = generating || !model.get("cut");
  };
  const paintStats = () => { stats.textContent = model.get("stats"); };
  const paintError = () => { error.textContent = model.get("error"); };

  paintLog();
  paintState();
  paintStats();
  paintError();
  const listeners = [
    ["change:log", paintLog],
    ["change:generating", paintState],
    ["change:busy", paintState],
    ["change:warming", paintState],
    ["change:cut", paintState],
    ["change:stats", paintStats],
    ["change:error", paintError],
  ];
  for (const [event, fn] of listeners) model.on(event, fn);
  return () => {
    for (const [event, fn] of listeners) model.off(event, fn);
  };
}

export default { render };
