"""Whether an answer with functions offered must be a call, decided from the model's own probability.

A small model offered functions answers some requests that need one in
words of its own ("Do I need an umbrella in Berlin?" -> "Yes, bring one"),
though it gives a call a fair chance: greedy decoding takes the likelier
first token, and a call loses to words it would have been right to lose to
only on small talk. Before the answer to a user's words, the model's
probability that it begins with a call (:class:`~s2s_rt.engines.base.WeighsCalls`)
is read; at :data:`CALL_PROBABILITY` or more the answer is required to be a
call, which function and which arguments still the model's. The server
(:mod:`s2s_rt.pipeline.responding`) and the evaluation
(:mod:`s2s_rt.evaluation.asking`) decide with :func:`decide_call`.
"""

from __future__ import annotations

import dataclasses

from s2s_rt.engines.base import LLMRequest, WeighsCalls

#: The probability of beginning with a call from which the answer must be one.
CALL_PROBABILITY = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class CallDecision:
    """The request to answer, and the model's probability of a call it was decided on (None: not weighed)."""

    request: LLMRequest
    probability: float | None = None


def decide_call(llm: object, asked: LLMRequest, threshold: float = CALL_PROBABILITY) -> CallDecision:
    """``asked``, required to be a call when the model gives one at least ``threshold``.

    Weighed only where the choice is the model's: functions offered, no
    call required already, and the answer is to the user's words (the last
    message), not to a function's result. A model that cannot weigh its
    calls (a remote one) answers as asked.

    Args:
        llm: the chat model.
        asked: the answer's request.
        threshold: the probability from which a call is required.

    Returns:
        the request to answer, and the probability it was decided on.
    """
    messages = asked.messages
    if not asked.tools or asked.require_tool or not messages or messages[-1].role != "user":
        return CallDecision(asked)
    if not isinstance(llm, WeighsCalls):
        return CallDecision(asked)
    probability = llm.call_probability(asked)
    if probability >= threshold:
        return CallDecision(dataclasses.replace(asked, require_tool=True), probability)
    return CallDecision(asked, probability)
