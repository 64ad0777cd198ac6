// JSONCell view: a schema or GBNF editor, a prompt, Generate / Stop, and the answer
// as a collapsible JSON tree (built with textContent only: model output is never HTML).
function el(tag, className, attrs = {}) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function tree(value, key) {
  const label = (node) => {
    if (key !== undefined) {
      const k = el("span", "wb-json-key");
      k.textContent = JSON.stringify(key) + ": ";
      node.append(k);
    }
  };
  if (value !== null && typeof value === "object") {
    const isArray = Array.isArray(value);
    const entries = isArray ? value.map((v, i) => [i, v]) : Object.entries(value);
    const box = el("details", "wb-json-node", { open: "" });
    const summary = el("summary", "");
    label(summary);
    const brace = el("span", "wb-json-brace");
    brace.textContent = isArray ? `[${entries.length}]` : `{${entries.length}}`;
    summary.append(brace);
    box.append(summary);
    for (const [k, v] of entries) box.append(tree(v, isArray ? undefined : k));
    return box;
  }
  const leaf = el("div", "wb-json-leaf");
  label(leaf);
  const v = el("span", `wb-json-${value === null ? "null" : typeof value}`);
  v.textContent = JSON.stringify(value);
  leaf.append(v);
  return leaf;
}

function render({ model, el: host }) {
  const root = el("div", "wb-json");
  const header = el("div", "wb-chat-header");
  const busy = el("span", "wb-badge wb-busy");
  const modeSelect = el("select", "wb-json-mode");
  for (const [value, text] of [["schema", "JSON Schema"], ["gbnf", "GBNF grammar"]]) {
    const option = el("option", "", { value });
    option.textContent = text;
    modeSelect.append(option);
  }
  const exampleSelect = el("select", "wb-json-examples");
  const temperature = el("input", "wb-json-temperature",
    { type: "number", min: 0, max: 2, step: 0.05 });
  const maxTokens = el("input", "wb-json-max-tokens", { type: "number", min: 1, step: 1 });
  const labelled = (text, input) => {
    const wrap = el("label", "");
    wrap.append(text + " ", input);
    return wrap;
  };
  header.append(busy, modeSelect, exampleSelect, labelled("temperature", temperature),
    labelled("max tokens", maxTokens));

  const editor = el("textarea", "wb-json-editor", { rows: 10, spellcheck: "false" });
  const prompt = el("textarea", "wb-json-prompt", { rows: 2, placeholder: "Prompt" });
  const buttons = el("div", "wb-chat-buttons");
  const run = el("button", "wb-json-run", { type: "button" });
  run.textContent = "Generate";
  const stop = el("button", "wb-json-stop", { type: "button" });
  stop.textContent = "Stop";
  const badge = el("span", "wb-badge wb-json-badge");
  const stats = el("span", "wb-chat-stats");
  buttons.append(run, stop, badge, stats);
  const error = el("div", "wb-error", { role: "alert" });
  const output = el("div", "wb-json-output");
  root.append(header, editor, prompt, buttons, error, output);
  host.appendChild(root);

  const editorTrait = () => (model.get("mode") === "gbnf" ? "gbnf_text" : "schema_text");
  const save = (name, value) => { model.set(name, value); model.save_changes(); };
  modeSelect.addEventListener("change", () => save("mode", modeSelect.value));
  exampleSelect.addEventListener("change", () => {
    const text = (model.get("examples") || {})[exampleSelect.value];
    if (text !== undefined) save("gbnf_text", text);
  });
  editor.addEventListener("input", () => save(editorTrait(), editor.value));
  prompt.addEventListener("input", () => save("prompt", prompt.value));
  temperature.addEventListener("change", () =>
    save("temperature", Math.max(0, Number(temperature.value) || 0)));
  maxTokens.addEventListener("change", () =>
    save("max_tokens", Math.max(1, Math.round(Number(maxTokens.value) || 1))));
  run.addEventListener("click", () => model.send({ type: "run" }));
  stop.addEventListener("click", () => model.send({ type: "stop" }));

  const paintInputs = () => {
    const mode = model.get("mode");
    modeSelect.value = mode;
    exampleSelect.style.display = mode === "gbnf" ? "" : "none";
    exampleSelect.replaceChildren(el("option", "", { value: "" }));
    exampleSelect.firstChild.textContent = "examples…";
    for (const name of Object.keys(model.get("examples") || {})) {
      const option = el("option", "", { value: name });
      option.textContent = name;
      exampleSelect.append(option);
    }
    const text = model.get(editorTrait());
    if (editor.value !== text) editor.value = text;
    if (prompt.value !== model.get("prompt")) prompt.value = model.get("prompt");
    temperature.value = model.get("temperature");
    maxTokens.value = model.get("max_tokens");
  };
  const paintOutput = () => {
    const json = model.get("value_json");
    output.replaceChildren();
    if (json) {
      output.append(tree(JSON.parse(json)));
    } else if (model.get("text")) {
      const pre = el("pre", "wb-json-text");
      pre.textContent = model.get("text");
      output.append(pre);
    }
  };
  const paintState = () => {
    const generating = Boolean(model.get("generating"));
    const isBusy = Boolean(model.get("busy"));
    busy.dataset.state = isBusy ? "busy" : "idle";
    busy.textContent = isBusy ? "\u25cf busy" : "\u25cb idle";
    root.dataset.generating = generating ? "true" : "false";
    run.disabled = generating;
    stop.disabled = !generating;
    const validity = model.get("validity");
    badge.dataset.state = validity;
    badge.textContent = validity ? `${validity}` : "";
    badge.title = model.get("validation");
    stats.textContent = model.get("stats");
    error.textContent = model.get("error");
  };

  paintInputs();
  paintOutput();
  paintState();
  const listeners = [
    ["change:mode", paintInputs],
    ["change:schema_text", paintInputs],
    ["change:gbnf_text", paintInputs],
    ["change:prompt", paintInputs],
    ["change:temperature", paintInputs],
    ["change:max_tokens", paintInputs],
    ["change:examples", paintInputs],
    ["change:value_json", paintOutput],
    ["change:text", paintOutput],
    ["change:generating", paintState],
    ["change:busy", paintState],
    ["change:validity", paintState],
    ["change:validation", paintState],
    ["change:stats", paintState],
    ["change:error", paintState],
  ];
  for (const [event, fn] of listeners) model.on(event, fn);
  return () => {
    for (const [event, fn] of listeners) model.off(event, fn);
  };
}

export default { render };
