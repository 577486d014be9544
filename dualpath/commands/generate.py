"""``dualpath generate``: answer one prompt with the single-engine runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dualpath.commands.args import EngineOptions, add_engine_arguments
from dualpath.errors import DualPathError

if TYPE_CHECKING:
    from argparse import ArgumentParser


@dataclass(frozen=True, kw_only=True)
class GenerateOptions(EngineOptions):
    """The ``dualpath generate`` command line."""

    prompt: str
    raw: bool = False
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`GenerateOptions`."""
    parser.add_argument("prompt")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(parser)


def run(options: GenerateOptions) -> int:
    """Print the answer."""
    from dualpath.engine.llm_engine import LLMEngine
    from dualpath.model.default_model import resolve_model
    from dualpath.request import SamplingParams

    engine = LLMEngine(resolve_model(options.model), options.engine_config())
    if engine.tokenizer is None:
        raise DualPathError("the model folder has no tokenizer.json")
    if options.raw:
        ids = engine.tokenizer.encode(options.prompt)
    else:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": options.prompt}])
    params = SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature,
                            top_p=options.top_p, seed=options.seed, stop=options.stop,
                            ignore_eos=options.ignore_eos)
    print(engine.generate([ids], params)[0].text.strip())
    return 0
