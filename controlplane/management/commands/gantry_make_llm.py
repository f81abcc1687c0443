"""`manage.py gantry_make_llm DIR`: write an untrained generative checkpoint
(a real Llama architecture and tokenizer, random weights) for demos and tests."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandParser

from upstream.checkpoints import UNTRAINED_NOTICE
from workers.untrained import SHAPES, TOKENIZERS, make_untrained_llm


class Command(BaseCommand):
    help = f"Write a small Llama checkpoint ({UNTRAINED_NOTICE}) to a folder."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("folder", type=Path)
        parser.add_argument("--size", choices=sorted(SHAPES), default="tiny")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--tokenizer", choices=TOKENIZERS, default="bpe",
            help="bpe: byte level, any text round-trips (structured output needs it); wordpiece: MiniLM's",
        )  # fmt: skip

    def handle(self, *args, **options) -> None:  # noqa: ANN002, ANN003
        folder = make_untrained_llm(
            options["folder"].resolve(), size=options["size"], seed=options["seed"], tokenizer=options["tokenizer"]
        )
        self.stdout.write(f"{folder}: LlamaForCausalLM ({options['size']}), {UNTRAINED_NOTICE}")
