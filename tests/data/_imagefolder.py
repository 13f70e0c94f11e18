"""ImageFolder's sample order, written out independently of the package, for the data tests."""
import os


def imagefolder_order(root):
    """ImageFolder's convention, written out independently of the package: classes are the
    sorted sub-folders; samples walk each class folder in sorted order, keeping image extensions."""
    exts = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, name))):
            for f in sorted(files):
                if f.lower().endswith(exts):
                    samples.append((os.path.join(dirpath, f), label))
    return classes, samples
