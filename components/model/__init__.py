"""What shared code reads of a model family, declared by the model: the contract (contract.py, protocols.py), its
attention layers and masks (attention.py), other ways it mixes tokens (token_mixing.py), its MoE layers
(moe_layer.py); and the start-up checks that refuse what a layout cannot honour (layout_checks.py,
undeclared_mixing.py)."""
