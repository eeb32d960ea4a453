"""``sonar plugins``: what was discovered, what failed, which platform was chosen and why."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("plugins", help="list discovered plugins and the selected platform")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from sonar import registry
    from sonar.platform import detect_platforms
    from sonar.plugins import plugin_report

    report = plugin_report()
    print("plugins loaded:")
    for name, module in sorted(report.loaded.items()):
        print(f"  {name:<16} {module}")
    if report.failed:
        print("plugins failed:")
        for name, error in sorted(report.failed.items()):
            print(f"  {name:<16} {error}")
    if report.skipped:
        print(f"plugins skipped (not in SONAR_PLUGINS): {', '.join(report.skipped)}")
    print("platforms:")
    try:
        selection = detect_platforms()
    except RuntimeError as exc:
        print(f"  error: {exc}")
        return 1
    for name, path in sorted(selection.candidates.items()):
        state = path or "not detected"
        if name in selection.errors:
            state = f"detection failed: {selection.errors[name]}"
        print(f"  {name:<16} {state}")
    chosen = selection.platform.name if selection.platform else "none"
    print(f"selected platform: {chosen} ({selection.reason})")
    print(f"model architectures: {', '.join(sorted(registry.model_architectures())) or 'none'}")
    print(f"weight formats: {', '.join(registry.weight_formats()) or 'none'}")
    print("quantization methods (platform: how it runs, tested or not):")
    for name, path in sorted(registry.quantization_methods().items()):
        print(f"  {name:<20} {_quantization_platforms(registry.load_registered('quantization method', name, {name: path}))}")
    print(f"logits processors: {', '.join(sorted(registry.logits_processors())) or 'none'}")
    return 0


def _quantization_platforms(method: type) -> str:
    platforms = sorted({*(method.platforms or ()), *method.execution}) or ["every platform"]
    shown = []
    for platform in platforms:
        how = method.execution.get(platform, "runs")
        shown.append(f"{platform}: {how} ({'tested' if platform in method.tested_by else 'untested'})")
    return "; ".join(shown)
