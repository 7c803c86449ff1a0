"""Where the benchmarks find the Azure LLM inference trace: `--trace PATH`, else the
environment variable FQ_AZURE_TRACE. The trace is public data, not part of the repository.

It is the Azure LLM inference trace 2023, conversation service (one hour on 2023-11-16,
19,366 requests; columns TIMESTAMP, ContextTokens, GeneratedTokens), published under
CC-BY in Microsoft's AzurePublicDataset repository with Patel et al., "Splitwise:
Efficient generative LLM inference using phase splitting", ISCA 2024. Fetch it once:

    base=https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data
    curl -fLo azure_llm_2023_conv.csv $base/AzureLLMInferenceTrace_conv.csv
    export FQ_AZURE_TRACE=$PWD/azure_llm_2023_conv.csv
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from producers.loadgen import TraceError

AZURE_TRACE_ENV = "FQ_AZURE_TRACE"
AZURE_TRACE_URL = (
    "https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data/"
    "AzureLLMInferenceTrace_conv.csv"
)
AZURE_TRACE_SOURCE = (
    "the Azure LLM inference trace 2023, conversation service (AzureLLMInferenceTrace_conv.csv "
    'of https://github.com/Azure/AzurePublicDataset, CC-BY; from Patel et al., "Splitwise: '
    'Efficient generative LLM inference using phase splitting", ISCA 2024)'
)
_HOW_TO_FETCH = (
    f"The trace is {AZURE_TRACE_SOURCE}. Fetch it with `curl -fLo "
    f"azure_llm_2023_conv.csv {AZURE_TRACE_URL}` and pass its path with --trace "
    f"or in {AZURE_TRACE_ENV}."
)


def add_trace_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="CSV",
        help=f"the Azure LLM conversation trace (default: ${AZURE_TRACE_ENV})",
    )


def azure_trace(flag: Path | None, environ: Mapping[str, str] = os.environ) -> Path:
    """The trace's path: `flag` (--trace) if given, else $FQ_AZURE_TRACE. TraceError, saying
    where the trace comes from and how to fetch it, if neither names a file."""
    if flag is not None:
        path, origin = flag, "--trace"
    elif environ.get(AZURE_TRACE_ENV):
        path, origin = Path(environ[AZURE_TRACE_ENV]), AZURE_TRACE_ENV
    else:
        raise TraceError(f"no Azure trace given (--trace or {AZURE_TRACE_ENV}). {_HOW_TO_FETCH}")
    if not path.is_file():
        raise TraceError(f"{path} (from {origin}): no such file. {_HOW_TO_FETCH}")
    return path
