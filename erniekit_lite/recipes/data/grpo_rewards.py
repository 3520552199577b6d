"""Example GRPO reward functions for `rewards: [{function: recipes/data/grpo_rewards.py:NAME}]`.

TRL calls a reward function once per generation batch with keyword arguments: `prompts` (each a list of chat
messages ending with the user's), `completions` (each `[{"role": "assistant", "content": text}]`), `completion_ids`
(token ids), every other data column (here `answer`: the reference answer or None), and `trainer_state`,
`log_extra`, `log_metric`. It returns one float per completion, or None where it does not apply.
"""


def digits(completions, **kwargs):
    """The share of a completion's non-space characters that are digits: an arithmetic answer is mostly digits. Unlike
    an exact-answer reward, it moves under a random policy, which is what lets the tiny quick-start model learn."""
    out = []
    for completion in completions:
        text = "".join(completion[0]["content"].split())
        out.append(sum(c.isdigit() for c in text) / len(text) if text else 0.0)
    return out
