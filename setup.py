"""fairseq-fwp: fast-weight programmers (linear Transformers, Performers, DPFP, DeltaNet) for fairseq."""
from setuptools import find_packages, setup

setup(
    name="fairseq-fwp",
    version="0.1.0",
    description="Fast-weight attention (sum and delta rules; linear, FAVOR+ and DPFP feature maps) for fairseq",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["fairseq_fwp", "fairseq_fwp.*"]),
    package_data={"fairseq_fwp.ops": ["README.md"]},
    install_requires=[
        "torch>=2.1",
        "numpy",
        "sacrebleu>=2.0",
        "sacremoses",
        "subword-nmt",
    ],
    extras_require={
        # The `fairseq` package. Upstream 0.12.2 does not build on Python >= 3.11,
        # where fairseq-fixed provides it. Not a hard requirement: fairseq-fixed
        # asks for torchaudio, which pins its own torch; scripts/setup_env.sh
        # installs it with --no-deps instead.
        "fairseq": [
            "fairseq==0.12.2; python_version < '3.11'",
            "fairseq-fixed==0.12.3.1; python_version >= '3.11'",
        ],
        "test": ["pytest"],
    },
)
