"""Write ``src/disttrain/vision/digits.npz``: the 1,797 handwritten digits the ViT demo trains on, as the package
ships them (``disttrain.vision.write_digits`` reads them; run once, needs scikit-learn, which the package does not).

The digits are the test part of the "Optical Recognition of Handwritten Digits" data set of the UCI Machine Learning
Repository (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0), as scikit-learn bundles them (``sklearn.datasets.load_digits``):
8x8 images of counts 0-16, and their labels. Stored as uint8 arrays ``images`` (1797, 8, 8) and ``labels`` (1797,).

    pip install scikit-learn && python tools/digits_data.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "src" / "disttrain" / "vision" / "digits.npz"


def main() -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.uint8)
    assert (images == digits.images).all() and images.shape == (1797, 8, 8)
    np.savez_compressed(OUT, images=images, labels=digits.target.astype(np.uint8))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
