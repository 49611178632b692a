"""`python -m golden check {topk,greedy,acceptance} --engine E.jsonl --golden DIR`: see golden/cli.py."""

import sys

from golden.cli import main

sys.exit(main())
