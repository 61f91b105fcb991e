"""The one place where environment variables become config overrides.

the source guides' runbooks set knobs in the environment (NSA_DDP_COMPRESS=bf16, NSA_NVTX=1, ...). They map
onto config keys here; explicit command-line overrides come after and win. Knobs that named
optional code paths of the earlier system are accepted and reported as unnecessary.
"""
from __future__ import annotations

import os

# env var -> (config key, value translation)
def _flag(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


ENV_TO_CONFIG: dict[str, tuple[str, object]] = {
    "NSA_DDP_COMPRESS": ("runtime.ddp_compress", lambda v: v.lower()),
    "NSA_DDP_BUCKET_MB": ("runtime.ddp_bucket_mb", int),
    "NSA_DDP_DISABLE_GC": ("runtime.disable_gc", _flag),
    "NSA_NVTX": ("runtime.nvtx", _flag),
    "NSA_SDPA_AUDIT": ("runtime.sdpa_audit", _flag),
}
# knobs of the earlier system whose code paths no longer exist: the vectorised path is the only path
UNNECESSARY = {
    "NSA_PREFILL_BATCHED": "the batched prefill is the only NSA path",
    "NSA_SEL_RANGES_V2": "vectorised selection is the only NSA path",
}


def env_overrides(environ: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """-> (['--runtime.ddp_compress=bf16', ...], ['note: ...']) from the environment."""
    environ = os.environ if environ is None else environ
    overrides, notes = [], []
    for name, (key, convert) in ENV_TO_CONFIG.items():
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            value = convert(raw)
        except ValueError:
            from train.errors import ConfigError

            raise ConfigError(f"environment {name}={raw!r} is not valid for {key}") from None
        overrides.append(f"--{key}={str(value).lower() if isinstance(value, bool) else value}")
    for name, why in UNNECESSARY.items():
        if name in environ:
            notes.append(f"note: {name} is accepted but unnecessary: {why}")
    return overrides, notes


def main() -> int:
    """`python -m train.env`: print the overrides the environment implies (used by the bash runbooks)."""
    import sys

    from train.errors import UserError

    try:
        overrides, notes = env_overrides()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    for note in notes:
        print(note, file=sys.stderr)
    print(" ".join(overrides))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
