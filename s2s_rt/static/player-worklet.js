// Queued playback of the assistant's 24 kHz PCM16 audio, without gaps.
//
// The page pushes chunks as they arrive ({type: "push", item, pcm}); they are
// played back to back, resampled to the context's rate by linear
// interpolation. The processor counts what it has really played, in 24 kHz
// samples, in total and per item: that count is what a barge-in truncates
// to. {type: "clear", item} drops everything queued at once and answers
// {type: "cleared", item, itemPlayed, played, dropped}.

const SOURCE_RATE = 24000;
const REPORT_EVERY = 8; // render quanta between progress reports (~20 ms)

class PlayerProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = SOURCE_RATE / sampleRate; // source samples per output sample
    this.queue = []; // [{item, data: Float32Array}]
    this.pos = 0; // fractional read position in queue[0].data
    this.queued = 0; // source samples waiting, including the unplayed part of queue[0]
    this.played = 0; // source samples played in total (whole ones)
    this.itemPlayed = new Map(); // item id -> source samples played
    this.current = null; // item id being played
    this.quanta = 0;
    this.wasPlaying = false;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(m) {
    if (m.type === "push") {
      const pcm = new Int16Array(m.pcm);
      if (pcm.length === 0) return;
      const data = new Float32Array(pcm.length);
      for (let i = 0; i < pcm.length; i++) data[i] = pcm[i] / 32768;
      this.queue.push({ item: m.item, data });
      this.queued += data.length;
    } else if (m.type === "clear") {
      const dropped = this.queued;
      this.queue = [];
      this.queued = 0;
      this.pos = 0;
      this.port.postMessage({
        type: "cleared",
        item: m.item,
        itemPlayed: this.itemPlayed.get(m.item) || 0,
        played: this.played,
        dropped,
      });
      this.current = null;
      this.wasPlaying = false; // stopped on purpose: no "drained"
      this.report();
    }
  }

  credit(item, n) {
    if (n <= 0) return;
    this.played += n;
    this.itemPlayed.set(item, (this.itemPlayed.get(item) || 0) + n);
    if (this.itemPlayed.size > 64) {
      // Old items are of no use any more; keep the map small.
      this.itemPlayed.delete(this.itemPlayed.keys().next().value);
    }
  }

  process(inputs, outputs) {
    const out = outputs[0];
    const ch0 = out[0];
    const frames = ch0.length;
    let i = 0;
    while (i < frames && this.queue.length > 0) {
      const head = this.queue[0];
      if (head.item !== this.current) {
        this.current = head.item;
        this.port.postMessage({ type: "started", item: head.item });
      }
      const data = head.data;
      const k = Math.floor(this.pos);
      const next = k + 1 < data.length ? data[k + 1] : this.queue.length > 1 ? this.queue[1].data[0] : data[k];
      ch0[i++] = data[k] + (next - data[k]) * (this.pos - k);
      this.pos += this.step;
      this.consume(k);
    }
    if (i < frames) ch0.fill(0, i);
    for (let c = 1; c < out.length; c++) out[c].set(ch0);
    const playing = this.queue.length > 0;
    if (this.wasPlaying && !playing) {
      this.port.postMessage({ type: "drained", item: this.current });
      this.current = null;
    }
    if (++this.quanta % REPORT_EVERY === 0 || playing !== this.wasPlaying) this.report();
    this.wasPlaying = playing;
    return true;
  }

  // The read position moved on from sample `k` of the head chunk: count the
  // samples passed as played, moving to the next chunks as they run out.
  consume(k) {
    let head = this.queue[0];
    while (head && this.pos >= head.data.length) {
      this.credit(head.item, head.data.length - k);
      this.queued -= head.data.length - k;
      this.pos -= head.data.length;
      this.queue.shift();
      k = 0;
      const next = this.queue[0];
      if (!next || next.item !== head.item) this.pos = 0; // a new item starts at its first sample
      head = next;
    }
    if (head) {
      const n = Math.floor(this.pos) - k;
      this.credit(head.item, n);
      this.queued -= n;
    }
  }

  report() {
    this.port.postMessage({
      type: "progress",
      played: this.played,
      queued: this.queued,
      playing: this.queue.length > 0,
      item: this.current,
    });
  }
}

registerProcessor("s2s-player", PlayerProcessor);
