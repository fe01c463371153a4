"""Axolotl's named chat templates (``chat_template: llama3 | chatml | gemma3 | phi_3 | ...``), written here as our own
Jinja templates from each family's documented turn format (text, turn markers, end-of-turn token, BOS, where the
system prompt goes). They are generated from one small table (`FORMATS`) rather than copied, so every template
renders turns the same way: ``[bos] header(role) + content + footer(role)`` per turn, optionally with the system
prompt folded into the first user turn, plus the assistant header for ``add_generation_prompt``.

`resolve_template` implements Axolotl's choices: a name from the table, ``tokenizer_default`` (the tokenizer's own),
``tokenizer_default_fallback_<name>`` (the tokenizer's own, else <name>) and ``jinja`` (``chat_template_jinja``:
a template inline, or the path of a ``.jinja`` file).

Tool calls and reasoning blocks are not rendered. Images are: with processor_type, mm_templates.py turns each
image item into the family's placeholder before the same templates render the turns (llava and qwen2_vl added).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from nd_parallel.config import ConfigError


@dataclass(frozen=True)
class TurnFormat:
    """How one family writes a conversation."""

    header: str
    """Text before a turn's content; ``{role}`` is the (renamed) role."""
    footer: str
    """Text after a turn's content (its end-of-turn marker and separator)."""
    bos: bool = False
    """Start with the tokenizer's bos_token."""
    system: str = "turn"
    """"turn": system is a turn of its own; "first_user": prepended to the first user turn (+ "\\n\\n");
    "last_user": prepended to a user turn that ends the conversation, else dropped (Pixtral's template)."""
    rename: dict = field(default_factory=dict)
    """Template role -> the name written in the header (Gemma writes "model" for "assistant")."""
    headers: dict = field(default_factory=dict)
    """Per-role header overriding ``header`` (Phi-3 and Mistral mark roles with their own tokens)."""
    footers: dict = field(default_factory=dict)
    """Per-role footer overriding ``footer``."""
    trim: bool = False
    """Strip the content's surrounding whitespace (Llama 3, Gemma, Cohere do)."""
    default_system: str | None = None
    """System prompt written when the conversation has none (Qwen2.5)."""
    think_last: bool = False
    """Qwen3: the last assistant turn after the last user turn starts with an empty <think></think> block."""

    def header_for(self, role: str) -> str:
        return self.headers.get(role, self.header).replace("{role}", self.rename.get(role, role))

    def footer_for(self, role: str) -> str:
        return self.footers.get(role, self.footer)


_CHATML = TurnFormat("<|im_start|>{role}\n", "<|im_end|>\n")
_GEMMA = TurnFormat("<start_of_turn>{role}\n", "<end_of_turn>\n", bos=True, system="first_user",
                    rename={"assistant": "model"}, trim=True)
_MISTRAL = dict(bos=True, system="first_user", header="", footer="")
FORMATS: dict[str, TurnFormat] = {
    "chatml": _CHATML,
    "qwen_25": TurnFormat("<|im_start|>{role}\n", "<|im_end|>\n",
                          default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "qwen3": TurnFormat("<|im_start|>{role}\n", "<|im_end|>\n", think_last=True),
    "qwen3_5": TurnFormat("<|im_start|>{role}\n", "<|im_end|>\n", think_last=True),
    "falcon_h1": TurnFormat("<|im_start|>{role}\n", "<|im_end|>\n", bos=True),
    "llama3": TurnFormat("<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>", bos=True, trim=True),
    "llama4": TurnFormat("<|header_start|>{role}<|header_end|>\n\n", "<|eot|>", bos=True, trim=True),
    "gemma": _GEMMA,
    "gemma3": _GEMMA,
    "gemma3n": _GEMMA,
    "gemma4": TurnFormat("<|turn>{role}\n", "<turn|>\n", bos=True, rename={"assistant": "model"}, trim=True),
    "phi_3": TurnFormat("<|{role}|>\n", "<|end|>\n", bos=True),
    "phi_35": TurnFormat("<|{role}|>\n", "<|end|>\n"),
    "phi_4": TurnFormat("<|im_start|>{role}<|im_sep|>", "<|im_end|>"),
    "cohere": TurnFormat("<|START_OF_TURN_TOKEN|>{role}", "<|END_OF_TURN_TOKEN|>", bos=True, trim=True,
                         rename={"system": "<|SYSTEM_TOKEN|>", "user": "<|USER_TOKEN|>",
                                 "assistant": "<|CHATBOT_TOKEN|>"}),
    "deepseek_v2": TurnFormat("", "", bos=True, headers={"user": "<｜User｜>", "assistant": "<｜Assistant｜>"},
                              footers={"system": "\n\n", "assistant": "{eos}"}),
    # Jamba 1.5: <|startoftext|> (its bos), then <|bom|><|role|> content<|eom|> per turn, a system turn always
    "jamba": TurnFormat("<|bom|><|{role}|> ", "<|eom|>", bos=True, default_system=""),
    "mistral_v1": TurnFormat(**_MISTRAL, headers={"user": " [INST] ", "assistant": " "},
                             footers={"user": " [/INST]", "assistant": "</s>"}),
    "mistral_v2v3": TurnFormat(**_MISTRAL, headers={"user": "[INST] ", "assistant": " "},
                               footers={"user": "[/INST]", "assistant": "</s>"}),
    "mistral_v3_tekken": TurnFormat(**_MISTRAL, headers={"user": "[INST]"}, footers={"user": "[/INST]",
                                                                                    "assistant": "</s>"}),
    "mistral_v7_tekken": TurnFormat("", "", bos=True, headers={"system": "[SYSTEM_PROMPT]", "user": "[INST]"},
                                    footers={"system": "[/SYSTEM_PROMPT]", "user": "[/INST]", "assistant": "</s>"}),
}
# Axolotl's gemma4_unified.jinja is byte-for-byte its gemma4.jinja (0.19 and later): the same text turns.
FORMATS["gemma4_unified"] = FORMATS["gemma4"]
# Axolotl names whose templates render images or audio through a processor: not text chat templates.
MULTIMODAL = ("llava", "pixtral", "qwen2_vl", "llama3_2_vision")
# Those written here (with processor_type; mm_templates.py turns image items into placeholders first): llava's
# "ROLE: " headers (system has none) and a space after each turn, Qwen2-VL's ChatML with its default system prompt,
# Pixtral's [INST] turns.
MM_FORMATS = {
    "llava": TurnFormat("{role}: ", " ", headers={"system": ""}, rename={"user": "USER", "assistant": "ASSISTANT"}),
    "qwen2_vl": TurnFormat("<|im_start|>{role}\n", "<|im_end|>\n", default_system="You are a helpful assistant."),
    # Pixtral: [INST]user[/INST]assistant</s>; the system prompt only before a final user turn (generation)
    "pixtral": TurnFormat("", "", bos=True, system="last_user", headers={"user": "[INST]"},
                          footers={"user": "[/INST]", "assistant": "{eos}"}),
}


# Templates that read a turn's content items themselves (an image item is written where it stands), so they are
# handed the items, not flattened turns. Llama 3.2 Vision (Meta's format, as Axolotl's llama3_2_vision.jinja renders
# it without tools): a conversation without images opens with a system turn carrying the knowledge cut-off and
# today's date (transformers' strftime_now; a fixed "26 Jul 2024" where the renderer has none, and `date_string`
# overrides both) followed by the system message; one with images takes no system message at all.
MM_JINJA = {"llama3_2_vision": (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='', image=false) -%}{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set first = messages[0]['content'] -%}"
    "{%- set ns.system = (first if first is string else first | selectattr('text', 'defined') "
    "| map(attribute='text') | join('')) | trim -%}{%- set turns = messages[1:] -%}{%- endif -%}"
    "{%- for m in turns -%}{%- if m['content'] is not string -%}{%- for item in m['content'] -%}"
    "{%- if item['type'] == 'image' -%}{%- set ns.image = true -%}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.image and ns.system -%}"
    "{{- raise_exception('Llama 3.2 Vision takes no system message in a conversation with images') -}}{%- endif -%}"
    "{%- if not ns.image -%}{%- if date_string is not defined -%}"
    "{%- set date_string = strftime_now('%d %b %Y') if strftime_now is defined else '26 Jul 2024' -%}{%- endif -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: ' "
    "+ date_string + '\n\n' + ns.system + '<|eot_id|>' -}}{%- endif -%}"
    "{%- for m in turns -%}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' -}}"
    "{%- if m['content'] is string -%}{{- m['content'] -}}{%- else -%}{%- for item in m['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|image|>' -}}{%- elif item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{{- '<|eot_id|>' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}")}


def _q(text: str) -> str:
    """A Jinja string literal (the eos placeholder becomes the tokenizer's eos_token)."""
    lit = "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"
    return lit.replace("{eos}", "' + eos_token + '")


def jinja(fmt: TurnFormat) -> str:
    """The Jinja template of a TurnFormat (what ``tokenizer.chat_template`` becomes)."""
    roles = sorted({"system", "user", "assistant", "tool", *fmt.headers, *fmt.footers})
    parts = ["{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"]
    if fmt.bos:
        parts.append("{{ bos_token }}")
    parts.append("{% set ns = namespace(prefix='', last_user=-1) %}{% set loop_messages = messages %}")
    if fmt.system in ("first_user", "last_user"):
        parts.append("{% if messages and messages[0]['role'] == 'system' %}{% set ns.prefix = messages[0]"
                     "['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}{% endif %}")
    elif fmt.default_system is not None:
        parts.append("{% if not messages or messages[0]['role'] != 'system' %}" + "{{ " + _q(
            fmt.header_for("system")) + " + " + _q(fmt.default_system) + " + " + _q(fmt.footer_for("system"))
            + " }}{% endif %}")
    parts.append("{% for m in loop_messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}"
                 "{% endif %}{% endfor %}")
    content = "(m['content'] | trim)" if fmt.trim else "m['content']"
    parts.append("{% for m in loop_messages %}{% set c = " + content + " %}"
                 "{% if m['role'] == 'user' and ns.prefix" + (" and loop.last" if fmt.system == "last_user" else "")
                 + " %}{% set c = ns.prefix + c %}{% set ns.prefix = '' %}"
                 "{% endif %}")
    for i, role in enumerate(roles):
        keyword = "if" if i == 0 else "elif"
        think = ""
        if fmt.think_last and role == "assistant":
            think = " + ('<think>\\n\\n</think>\\n\\n' if loop.index0 > ns.last_user and loop.last else '')"
        parts.append("{% " + keyword + f" m['role'] == '{role}' %}}{{{{ {_q(fmt.header_for(role))}{think} + c + "
                     f"{_q(fmt.footer_for(role))} }}}}")
    parts.append("{% else %}{{ " + _q(fmt.header).replace("{role}", "' + m['role'] + '") + " + c + "
                 + _q(fmt.footer) + " }}{% endif %}{% endfor %}")
    parts.append("{% if add_generation_prompt %}{{ " + _q(fmt.header_for("assistant")) + " }}{% endif %}")
    return "".join(parts)


def template_problem(name, multimodal: bool = False) -> str | None:
    """Why ``chat_template: name`` cannot be used (None when it can): read at the config stage. ``multimodal``: a
    processor renders images (processor_type), so the vision templates of mm_templates.py are known too."""
    if name in (None, "tokenizer_default", "jinja") or name in FORMATS:
        return None
    base = name.removeprefix("tokenizer_default_fallback_") if isinstance(name, str) else name
    if base in FORMATS:
        return None
    if base in MULTIMODAL:
        if multimodal:
            return None
        return (f"chat_template={name!r} renders images through a processor: set processor_type: AutoProcessor "
                f"(a vision-language checkpoint), or use one of the text templates ({', '.join(sorted(FORMATS))})")
    return (f"chat_template={name!r} is not a chat template nd-parallel train knows; use tokenizer_default, "
            f"tokenizer_default_fallback_<name>, jinja (with chat_template_jinja) or one of: "
            f"{', '.join(sorted(FORMATS))}")


def resolve_template(name: str | None, inline: str | None, tokenizer) -> str | None:
    """The Jinja text to set on the tokenizer (None: keep the tokenizer's own)."""
    if name is None and inline:
        name = "jinja"
    if name in (None, "tokenizer_default"):
        return None
    if name == "jinja":
        if not inline:
            raise ConfigError("chat_template: jinja needs chat_template_jinja: '{% for message in messages %}...' "
                              "(a template, or the path of a .jinja file)")
        if os.path.isfile(inline):  # Axolotl: a path to a template file is read
            with open(inline, encoding="utf-8") as f:
                return f.read()
        return inline
    if name.startswith("tokenizer_default_fallback_"):
        if getattr(tokenizer, "chat_template", None):
            return None
        name = name.removeprefix("tokenizer_default_fallback_")
    problem = template_problem(name)
    if problem:
        raise ConfigError(problem)
    return jinja(FORMATS[name])
