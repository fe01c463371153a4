"""Axolotl's instruction record formats (`type: alpaca`, `alpaca:<style>`, `alpaca_chat`, `jeopardy[:<style>]`):
one prompt built from (instruction, input) and one trained response.

Axolotl writes these types as `<record kind>:<prompt style>`. The record kind says which fields hold the
instruction, the input and the response; the style says how the system line and the turn are written. The
prompt is the system line (the long Alpaca sentence, with or without input) followed by the turn; the response
follows it, then EOS. Only the response and its EOS are trained unless train_on_inputs.

Format facts read from Axolotl 0.19 (`prompters.AlpacaPrompter.match_prompt_style`, `prompt_tokenizers`):
- a record with an empty input uses the no-input system sentence and turn;
- `jeopardy` reads question (instruction), category (input) and answer, and trains "what is <answer>". Its
  prompter's own Jeopardy sentence is never used by the prompt builder, so the prompt is the Alpaca one;
- `alpaca_chat` is the alpaca record with the chat style (`prompt_strategies/alpaca_chat.load`).
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.")
SYSTEM_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes " \
                  "the request."


@dataclass(frozen=True)
class Style:
    system: str
    """How the system sentence is written ({system})."""
    turn: str
    """The turn with an input ({instruction}, {input})."""
    turn_no_input: str
    """The turn without one ({instruction})."""


STYLES = {
    "instruct": Style("{system}\n\n", "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
                      "### Instruction:\n{instruction}\n\n### Response:\n"),
    "chat": Style("SYSTEM: {system}\n", "USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:"),
    "chatml": Style("<|im_start|>system\n{system}<|im_end|>\n",
                    "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
                    "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"),
    # As Axolotl writes it: with an input, no newline around the input or after <|assistant|>.
    "phi": Style("<|system|>\n{system}<|end|>\n", "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
                 "<|user|>\n{instruction}<|end|>\n<|assistant|>\n"),
}

# record kind -> (instruction field, input field, response field, text written before the response, whether the
# input field must be there): Axolotl reads an alpaca record's input only if present, a jeopardy record's always.
RECORDS = {"alpaca": ("instruction", "input", "output", "", False),
           "jeopardy": ("question", "category", "answer", "what is ", True)}
ALIASES = {"alpaca_chat": "alpaca:chat"}


def parse(kind: str) -> tuple[str, str] | None:
    """(record kind, style) of an instruction type, or None when `kind` is not one."""
    kind = ALIASES.get(kind, kind)
    base, _, style = kind.partition(":")
    if base not in RECORDS or (style and style not in STYLES):
        return None
    return base, style or "instruct"


def problem(kind: str) -> str | None:
    """The fix for an instruction record with an unknown style (`alpaca:vicuna`), for the one message; else None."""
    base, sep, style = kind.partition(":")
    if base in RECORDS and sep and style not in STYLES:
        return f"{base}:<style> with one of Axolotl's prompt styles ({', '.join(STYLES)})"
    return None


def prompt(style: str, instruction: str, extra: str) -> str:
    """The text before the response: system sentence and turn, with or without the input."""
    s = STYLES[style]
    if extra:
        return s.system.format(system=SYSTEM) + s.turn.format(instruction=instruction, input=extra)
    return s.system.format(system=SYSTEM_NO_INPUT) + s.turn_no_input.format(instruction=instruction)
