"""Processes working together: process groups and the DeviceMesh (mesh.py), replica groups that fail and rejoin on
torchft (fault_tolerance.py) and DiLoCo's outer step between them (diloco.py)."""
