from setuptools import find_packages, setup

setup(
    name="dflash-trt",
    version="0.1.0",
    description="DFlash block-diffusion speculative decoding for TensorRT-LLM, with a PyTorch reference runtime",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["dflash_trt", "dflash_trt.*"]),
    # the upstream snapshots the code reads at run time (a wheel, not only an editable install, needs them)
    package_data={"dflash_trt": ["deploy_snapshot.json"], "dflash_trt.trtllm": ["api_snapshot.json"]},
    install_requires=[
        "torch>=2.5",  # enable_gqa in scaled_dot_product_attention
        "safetensors>=0.4",
        "transformers>=4.45",  # tokenizers and chat templates only; no modeling code at run time
        "tokenizers>=0.19",
        "numpy",
        "tqdm",
        "pyyaml",  # build_configs/ (dflash-trt build)
    ],
    extras_require={
        "trt": ["tensorrt_llm", "tensorrt", "nvidia-modelopt"],
        "mpi": ["mpi4py"],
        # Triton kernels on CUDA (DFLASH_KERNELS=auto uses them there; torch references elsewhere)
        "kernels": ["triton>=3.6"],
        # dflash-trt serve (OpenAI-compatible HTTP); triton-repo needs nothing beyond the runtime
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "prometheus_client>=0.20", "httpx>=0.27"],
        # fetch-models converts a GGUF checkpoint once, through transformers' GGUF loader;
        # the GSM-Symbolic prompt sets are reasoning-gym's generators; bench plots with matplotlib
        "fetch": ["gguf>=0.10", "accelerate", "reasoning-gym==0.1.25", "pyyaml", "matplotlib"],
        # bench --peer llama.cpp (compiles llama.cpp on install: not in dev/CI); --peer transformers needs nothing more
        "peers": ["llama-cpp-python==0.3.36", "diskcache"],
        # dev: the tests' oracles too: ModelOpt (TensorRT-LLM checkpoint format), Triton's own
        # model-config protobuf (tritonclient), the openai client against our server
        "dev": [
            "pytest>=8", "hypothesis>=6.100", "scipy", "gguf>=0.10", "accelerate", "reasoning-gym==0.1.25", "pyyaml", "matplotlib",
            "nvidia-modelopt==0.47.0", "requests", "huggingface_hub",
            "fastapi>=0.110", "uvicorn>=0.29", "prometheus_client>=0.20", "httpx>=0.27",
            "tritonclient[grpc]>=2.40", "openai>=1.0",
            # kernels under TRITON_INTERPRET=1 and AOT-compiled for sm_90/100/103; TensorRT-RTX's builder
            # as the CPU check of plain TensorRT network code
            "triton==3.9.0", "tensorrt-rtx==1.7.1.116", "mpi4py",
        ],
    },
    entry_points={"console_scripts": ["dflash-trt=dflash_trt.cli:main"]},
)
