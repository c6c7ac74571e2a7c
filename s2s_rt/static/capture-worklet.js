// Microphone capture: mixes to mono, resamples the context's rate to 24 kHz
// and posts PCM16 chunks (Int16Array buffers, transferred) to the page.
//
// Downsampling runs a windowed-sinc low-pass at the input rate first, so
// nothing above the new Nyquist folds back into the speech band; then linear
// interpolation picks the output samples. Upsampling (a 16 kHz context)
// only interpolates.

const TARGET_RATE = 24000;

function lowpass(cutoff, taps) {
  // cutoff in cycles per input sample; Blackman window; unit DC gain.
  const h = new Float32Array(taps);
  const mid = (taps - 1) / 2;
  let sum = 0;
  for (let n = 0; n < taps; n++) {
    const x = n - mid;
    const sinc = x === 0 ? 2 * cutoff : Math.sin(2 * Math.PI * cutoff * x) / (Math.PI * x);
    const w = 0.42 - 0.5 * Math.cos((2 * Math.PI * n) / (taps - 1)) + 0.08 * Math.cos((4 * Math.PI * n) / (taps - 1));
    h[n] = sinc * w;
    sum += h[n];
  }
  for (let n = 0; n < taps; n++) h[n] /= sum;
  return h;
}

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = (options && options.processorOptions) || {};
    this.chunkSamples = opts.chunkSamples || 480; // 20 ms at 24 kHz
    this.step = sampleRate / TARGET_RATE; // input samples per output sample
    this.filter = this.step > 1 ? lowpass(0.45 / this.step, 47) : null;
    // Raw input history for the filter, newest last.
    this.history = new Float32Array(this.filter ? this.filter.length - 1 : 0);
    this.mono = new Float32Array(128);
    this.filtered = new Float32Array(129); // [previous sample, ...this block]
    this.pos = 0; // next output position in `filtered`
    this.out = new Int16Array(this.chunkSamples);
    this.fill = 0;
    this.energy = 0;
  }

  process(inputs) {
    const input = inputs[0];
    if (!input || input.length === 0 || input[0].length === 0) return true;
    const frames = input[0].length;
    if (this.mono.length < frames) {
      this.mono = new Float32Array(frames);
      const grown = new Float32Array(frames + 1);
      grown[0] = this.filtered[0];
      this.filtered = grown;
    }
    const mono = this.mono;
    for (let i = 0; i < frames; i++) {
      let s = 0;
      for (let c = 0; c < input.length; c++) s += input[c][i];
      mono[i] = s / input.length;
    }
    const y = this.filtered;
    if (this.filter) {
      const h = this.filter;
      const hist = this.history;
      const taps = h.length;
      const keep = taps - 1;
      for (let i = 0; i < frames; i++) {
        // y[i+1] = sum_k h[k] * x[i - k], x before this block from `hist`.
        let acc = 0;
        for (let k = 0; k < taps; k++) {
          const j = i - k;
          acc += h[k] * (j >= 0 ? mono[j] : hist[keep + j]);
        }
        y[i + 1] = acc;
      }
      if (frames >= keep) {
        hist.set(mono.subarray(frames - keep, frames));
      } else {
        hist.copyWithin(0, frames);
        hist.set(mono.subarray(0, frames), keep - frames);
      }
    } else {
      y.set(mono.subarray(0, frames), 1);
    }
    // Interpolate every output whose right neighbour has arrived: pos < last.
    const last = frames; // index of the newest sample in y
    let pos = this.pos;
    while (pos < last) {
      const i = Math.floor(pos);
      const f = pos - i;
      const v = y[i] + (y[i + 1] - y[i]) * f;
      this.push(v);
      pos += this.step;
    }
    // y[last] becomes y[0] of the next block; positions shift with it (pos stays >= 0).
    this.pos = pos - last;
    y[0] = y[last];
    return true;
  }

  push(v) {
    const c = v > 1 ? 1 : v < -1 ? -1 : v;
    this.energy += c * c;
    this.out[this.fill++] = c < 0 ? c * 32768 : c * 32767;
    if (this.fill === this.chunkSamples) {
      const level = Math.sqrt(this.energy / this.chunkSamples);
      this.port.postMessage({ pcm: this.out.buffer, level }, [this.out.buffer]);
      this.out = new Int16Array(this.chunkSamples);
      this.fill = 0;
      this.energy = 0;
    }
  }
}

registerProcessor("s2s-capture", CaptureProcessor);
