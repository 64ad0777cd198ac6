// Microphone cell: record in the browser (getUserMedia + MediaRecorder) with a level meter,
// or pick an audio file; the encoded bytes go to Python as a binary buffer with
// {type: "audio", mime, name}. Python decodes, transcribes and fills `text` and `segments`.

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function formatTime(seconds) {
  const m = Math.floor(seconds / 60);
  const s = (seconds - 60 * m).toFixed(2).padStart(5, "0");
  return `${m}:${s}`;
}

function render({ model, el: host }) {
  const root = el("div", "wb-mic");
  const bar = el("div", "wb-mic-buttons");
  const record = el("button", "wb-mic-record", "\u25cf Record");
  const stop = el("button", "wb-mic-stop", "\u25a0 Stop");
  const upload = el("label", "wb-mic-upload", "Transcribe a file\u2026");
  const fileInput = el("input");
  fileInput.type = "file";
  fileInput.accept = "audio/*,video/webm,.wav,.flac,.ogg,.mp3,.m4a,.webm";
  upload.appendChild(fileInput);
  const meter = el("div", "wb-mic-meter");
  const level = el("div", "wb-mic-level");
  meter.appendChild(level);
  const clock = el("span", "wb-mic-clock", "0:00.00");
  bar.append(record, stop, meter, clock, upload);
  const status = el("div", "wb-mic-status");
  const error = el("div", "wb-error");
  const text = el("div", "wb-mic-text");
  const segments = el("table", "wb-mic-segments");
  root.append(bar, status, error, text, segments);
  host.appendChild(root);

  let recorder = null;
  let stream = null;
  let audioContext = null;
  let frame = 0;
  let started = 0;

  const paint = () => {
    const busy = Boolean(model.get("busy"));
    const recording = recorder !== null;
    record.disabled = recording || busy;
    stop.disabled = !recording;
    fileInput.disabled = recording || busy;
    root.dataset.state = recording ? "recording" : busy ? "transcribing" : "idle";
    status.textContent = model.get("status");
    error.textContent = model.get("error");
    text.textContent = model.get("text");
    segments.replaceChildren();
    for (const s of model.get("segments") || []) {
      const row = el("tr", "wb-mic-segment");
      row.append(el("td", "wb-mic-time", `${formatTime(s.start)} \u2192 ${formatTime(s.end)}`),
                 el("td", "", s.text));
      segments.appendChild(row);
    }
  };

  const send = async (blob, name) => {
    const buffer = await blob.arrayBuffer();
    model.send({ type: "audio", mime: blob.type || "", name }, undefined, [buffer]);
  };

  const meterLoop = (analyser) => {
    const data = new Float32Array(analyser.fftSize);
    const tick = () => {
      analyser.getFloatTimeDomainData(data);
      let sum = 0;
      for (const v of data) sum += v * v;
      const rms = Math.sqrt(sum / data.length);
      level.style.width = `${Math.min(100, Math.round(rms * 400))}%`;
      clock.textContent = formatTime((performance.now() - started) / 1000);
      frame = requestAnimationFrame(tick);
    };
    tick();
  };

  record.addEventListener("click", async () => {
    model.set("error", "");
    model.save_changes();
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    } catch (e) {
      model.set("error", `microphone: ${e.name}: ${e.message}`);
      model.save_changes();
      return;
    }
    audioContext = new AudioContext();
    const analyser = audioContext.createAnalyser();
    analyser.fftSize = 2048;
    audioContext.createMediaStreamSource(stream).connect(analyser);
    const chunks = [];
    recorder = new MediaRecorder(stream);
    recorder.addEventListener("dataavailable", (e) => { if (e.data.size) chunks.push(e.data); });
    recorder.addEventListener("stop", async () => {
      cancelAnimationFrame(frame);
      level.style.width = "0%";
      for (const track of stream.getTracks()) track.stop();
      if (audioContext) audioContext.close();
      const blob = new Blob(chunks, { type: recorder.mimeType });
      recorder = null;
      paint();
      await send(blob, "recording");
    });
    started = performance.now();
    recorder.start(250);
    meterLoop(analyser);
    paint();
  });

  stop.addEventListener("click", () => { if (recorder) recorder.stop(); });

  fileInput.addEventListener("change", async () => {
    const file = fileInput.files && fileInput.files[0];
    if (file) await send(file, file.name);
    fileInput.value = "";
  });

  const events = ["change:text", "change:segments", "change:status", "change:error",
                  "change:busy"];
  for (const e of events) model.on(e, paint);
  paint();
  return () => {
    for (const e of events) model.off(e, paint);
    cancelAnimationFrame(frame);
    if (recorder) recorder.stop();
  };
}

export default { render };
