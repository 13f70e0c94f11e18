"""The tables and plot of ``python -m mcallreduce.data bench``, from its results."""
from __future__ import annotations

import sys
from typing import List

from ..bench.output import pyplot, save_png


def format_decode_table(d: dict) -> List[str]:
    ref = d[d["reference"]]
    notes = {"torch": "torch uint8 antialiased bilinear (default)", "pil": "Pillow antialiased bilinear",
             "cv2": "OpenCV INTER_LINEAR, not antialiased (opt-in)"}
    lines = [f"One thread, the first {d['images']} JPEGs of the store held in memory, every case round robin "
             f"in chunks of 25 images, {d['rounds']} rounds; ratios of total times.", "",
             "| one core, bytes in memory | images/s | / decoder alone |", "|---|---:|---:|",
             f"| simplejpeg full decode (RGB) | {d['simplejpeg_full_decode']:.0f} | "
             f"{d['simplejpeg_full_decode'] / ref:.2f} |",
             f"| Pillow full decode (RGB) | {d['pil_full_decode']:.0f} | {d['pil_full_decode'] / ref:.2f} |"]
    if "turbo_full_decode" in d:
        lines.append(f"| turbo full decode (RGB; our extension, system libjpeg-turbo "
                     f"{d.get('libjpeg_turbo_version')}) | {d['turbo_full_decode']:.0f} | "
                     f"{d['turbo_full_decode'] / ref:.2f} |")
    for r in d["resizers"]:
        bold = "**" if r == d["resizer"] else ""
        lines.append(f"| decode ({d['decoder']}) + RRC-224 + flip, uint8 out; resize: {notes.get(r, r)} | "
                     f"{d['rrc_' + r]:.0f} | {bold}{d['ratio_rrc_' + r]:.2f}{bold} |")
    if "rrc_simplejpeg" in d:
        lines.append(f"| decode (simplejpeg, whole image) + RRC-224 + flip, uint8 out; resize: {d['resizer']} | "
                     f"{d['rrc_simplejpeg']:.0f} | {d['ratio_rrc_simplejpeg']:.2f} |")
    lines += [f"| the same ({d['resizer']}) + batch Normalize to float32 ({d['batch_size']} per batch, "
              f"numpy on the CPU) | {d['rrc_batch_normalize']:.0f} | {d['ratio_rrc_batch_normalize']:.2f} |",
              f"| TrainTransform() default: + per-image normalise to float32 | {d['train_transform']:.0f} | "
              f"{d['ratio_train_transform']:.2f} |",
              "", f"Decode + RRC-224 ({d['decoder']}, resize {d['resizer']}) / decoder alone: "
                  f"**{d['ratio_to_decoder_alone']:.2f}x**; with normalisation per batch "
                  f"{d['ratio_rrc_batch_normalize']:.2f}x, per image {d['ratio_train_transform']:.2f}x."]
    if "ratio_to_own_full_decode" in d:
        lines[-1] += (f" Against the extension's own full decode (same libjpeg-turbo build): "
                      f"{d['ratio_to_own_full_decode']:.2f}x.")
    return lines


def format_table(r: dict) -> str:
    mb = 1 << 20
    lines = [f"`{r['command']}`", "",
             f"{r['images']} JPEGs, {r['bytes'] / mb:.1f} MiB (mean {r['mean_image_bytes'] / 1024:.0f} KiB), "
             f"{r['threads']} decode threads, batch {r['batch_size']}, decoder {r['decoder']}, {r['cpus']} CPUs", "",
             "| path | images/s (decode + RRC-224) | epoch s | vs in-memory | images/s, bytes only (no decode) |",
             "|---|---:|---:|---:|---:|"]
    for key, name in source_names(r):
        x = r[key]
        lines.append(f"| {name} | {x['images_per_s']:.0f} | {x['epoch_s']:.2f} | "
                     f"{x['images_per_s'] / r['memory']['images_per_s']:.2f} | "
                     f"{r['read_only'][key]['images_per_s']:.0f} |")
    lines += ["", f"In-memory / cold: **{r['ratio_memory_vs_cold']:.2f}x**; in-memory / warm: "
                  f"**{r['ratio_memory_vs_warm']:.2f}x**."]
    if r.get("read_limits"):
        lines[-1] += " In-memory / cold with the disk's reads limited (blkio cgroup on device " + \
            f"{r['read_limit_device']}): " + "; ".join(
                f"{x['label']} **{r['ratio_memory_vs_cold_' + x['key']]:.2f}x**" for x in r["read_limits"]) + "."
    lines += [""] + format_decode_table(r["decode_per_core"])
    if r["memory_runs"]:
        lines += ["", "| ranks on host | store share MiB | store resident on host MiB (sum of segment PSS) | ratio |"
                      " RSS/rank MiB | PSS/rank MiB | PSS host total MiB | images/s host |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m in r["memory_runs"]:
            lines.append(f"| {m['ranks']} | {m['share_bytes'] / mb:.1f} | {m['host_store_resident'] / mb:.1f} | "
                         f"{m['host_store_ratio']:.3f} | {m['rank_rss_mean'] / mb:.0f} | {m['rank_pss_mean'] / mb:.0f} | "
                         f"{m['host_pss_total'] / mb:.0f} | {m['images_per_s_host']:.0f} |")
    return "\n".join(lines)


def source_names(r: dict) -> List[tuple]:
    """(result key, row name) of every source path a bench result holds, in table order."""
    names = [("folder_cold", "ImageFolder, cold page cache")]
    names += [(f"folder_cold_{x['key']}", f"ImageFolder, cold, disk reads limited to {x['label']}")
              for x in r.get("read_limits", [])]
    return names + [("folder_warm", "ImageFolder, warm page cache"), ("memory", "in-memory store")]


def plot(r: dict, path: str) -> None:
    try:
        plt = pyplot()
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = [k for k, _ in source_names(r)]
    names = [k.replace("folder_cold_", "cold\n").replace("folder_", "").replace("_", " ").replace("+", "\n+")
             for k in keys]
    colors = {"folder_cold": "#999", "folder_warm": "#69c", "memory": "#2a2"}
    axes[0].bar(names, [r[k]["images_per_s"] for k in keys], color=[colors.get(k, "#c96") for k in keys])
    axes[0].tick_params(axis="x", labelsize=8)
    axes[0].set_ylabel("images/s")
    axes[0].set_title(f"{r['threads']} threads, batch {r['batch_size']}, RRC-224")
    if r["memory_runs"]:
        ranks = [m["ranks"] for m in r["memory_runs"]]
        mb = 1 << 20
        axes[1].plot(ranks, [m["host_store_resident"] / mb for m in r["memory_runs"]], "o-", label="store resident / host")
        axes[1].plot(ranks, [m["share_bytes"] / mb for m in r["memory_runs"]], "k--", label="JPEG bytes of share")
        axes[1].plot(ranks, [m["host_pss_total"] / mb for m in r["memory_runs"]], "s-", label="all PSS / host")
        axes[1].set_xlabel("ranks on the host")
        axes[1].set_ylabel("MiB")
        axes[1].set_xticks(ranks)
        axes[1].legend()
        axes[1].set_title("one shared copy per host")
    save_png(fig, path, dpi=100)
