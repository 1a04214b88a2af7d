"""Every family is parallelized by models/decoder_parallelize.py: tied embeddings stay one matrix after tensor
parallelism in each family that can tie them (DeepSeek-V3 ties them when a Hugging Face import says so)."""

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from conftest import on_ranks

from components.config import load_config
from components.distributed.mesh import ParallelDims
from models import deepseek_v3, llama3, qwen3
from models.families import model_config_class

FAMILIES = {"debug_model": llama3, "debug_qwen3": qwen3, "debug_deepseek_v3": deepseek_v3}


def check_tied_after_tensor_parallelism(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    for config_file, family in FAMILIES.items():
        config = load_config(["--job.config_file", f"{config_file}.toml", "--parallelism.tensor_parallel_degree", "2",
                              "--parallelism.data_parallel_shard_degree", "1"], model_config_class)
        dims = ParallelDims.from_config(config.parallelism, 2)
        args = replace(copy.deepcopy(family.build_model_args(config, 2048)), tie_embeddings=True)
        with torch.device("meta"):
            model = family.Transformer(args)
        assert model.output.weight is model.tok_embeddings.weight
        model = family.parallelize(model, dims, dims.build_mesh("cpu"), config, torch.device("cpu"))
        assert model.output.weight is model.tok_embeddings.weight, config_file
    dist.destroy_process_group()


@pytest.mark.slow
def test_tied_embeddings_are_one_matrix_after_tensor_parallelism_in_every_family(tmp_path):
    on_ranks(check_tied_after_tensor_parallelism, 2, str(tmp_path / "store"))
