"""The load script (``bin/s2s-rt-load``, ``s2s-rt bench``): latency, capacity and memory.

Five modes, each one command:

``talk`` (default)
    N concurrent sessions each speak M questions at real-time pace (PCM16
    24 kHz in 20 ms appends, like a microphone: silence, a question, silence
    while the answer comes) and wait for each answer. Per turn it records the
    end of the user's speech (when the append holding the last voiced sample
    was sent), ``speech_stopped``, the transcription's ``completed``,
    ``response.created``, the first audio delta and ``response.done``, and
    prints p50/p95/p99 of every interval.

``listen``
    Sessions that mostly listen: audio streams continuously, a question now
    and then (by default transcribed but not answered). Ramps the number of
    sessions up step by step and reports, per step, the delay from an audio
    chunk's arrival to its VAD decision; the knee is the last step whose p99
    stays under ``--target-ms``. The client cannot see the server's
    per-chunk decision, so it measures it through the protocol: after an
    append it sends ``input_audio_buffer.clear`` (only in silence, far from
    any turn), which the server handles in the session's VAD stage after
    every earlier chunk has been scored; the time until
    ``input_audio_buffer.cleared`` arrives is the chunk-to-decision delay
    plus the trip back. ``speech_started``/``speech_stopped`` of the rare
    turns give a second, independent measure (time from sending the chunk
    that completes the deciding 32 ms VAD window to the event).

``memory``
    Starts the server once per ``--pool-sizes`` value, fills every slot with
    a listening session, and reports RSS idle and with all slots active: the
    cost of one extra slot.

``copies``
    Loads the default stack ``--copies`` times in this process and reports
    RSS after each: what a slot would cost with its own models
    (``bin/s2s-rt-model-copies``).

``suite``
    Every benchmark of BENCHMARKS.md, each in its own process, into
    ``--out`` (JSON, tables, ``summary.md``): what ``make bench`` runs.

Every mode checks what it hears: an event naming a session, item or
response id that belongs to another session (or that this session never
saw introduced) is a *foreign* event and fails the run, as does a turn whose
expected events do not all arrive (*lost*), an ``error`` event, or a
rejection (``session_limit_reached``). Exit status 0 means none of these
happened.

With ``--spawn`` it starts the server itself (``python -m s2s_rt serve``)
and reads the process's CPU time and RSS from ``/proc/PID``; with ``--url``
it uses a running one (``--pid`` for its ``/proc`` figures). It always reads
the server's ``/metrics`` before and after.

The parts of this package, one concept each:

``cli``
    the command line (``parse_args``), which mode runs (``run_async``), ``main``.
``talk``, ``listen``, ``memory``, ``copies``, ``suite``
    the five modes.
``session``
    one simulated Realtime session: connect, configure, speak, check every event.
``turn``
    one spoken question: its event times, intervals and record.
``run``
    what every session of one run shares: settings, metronome, id ownership,
    counters and failures; the client's own loop lag; pacing and progress.
``microphone``
    the uplink: pre-encoded appends, a session's microphone, the metronome.
``server``
    the server under test: spawned or attached, stopped, its turn log.
``metrics``
    the server's ``/metrics``: parsing, deltas, the server figures of a window.
``procfs``
    ``/proc``: CPU time, RSS and the event-loop thread of a process; the machine.
``stats``
    percentiles and summaries.
``report``
    the report's common JSON head and the text tables printed from it.

The questions' audio comes from :mod:`s2s_rt.speech_cache`.
"""
