"""Read a gateway YAML as praisonai-bot 0.1.16 would apply it, see where each value came from
and what it warns about, then build the gate it describes. Needs PyYAML (admitgate[config])."""

from pathlib import Path

import admitgate.config

HERE = Path(__file__).resolve().parent


def main() -> None:
    # Keyword overrides act as the command's flags do.
    settings = admitgate.config.load(HERE / "gateway.yaml", queue_depth=64)
    print("ceiling", settings.max_concurrent_runs, "soft RSS", settings.soft_rss_mb, "MiB")
    print("drain_timeout", settings.drain_timeout, "s (a BotOS setting, not the gate's)")
    print("queue_depth from", settings.settings["queue_depth"].source)  # "override"
    print("warnings:", [w.code for w in settings.warnings])
    gate = settings.build_gate()  # = admitgate.build_admission_gate(**settings.gate_kwargs())
    assert gate is not None
    print(gate.stats())

    try:
        admitgate.config.load(HERE / "gateway.yaml", max_concurrent_runs=-1)
    except admitgate.config.ConfigError as invalid:  # a ValueError naming the key and value
        print("refused:", invalid.key, invalid.value)


if __name__ == "__main__":
    main()
