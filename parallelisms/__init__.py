"""Each parallelism or efficiency technique as a plain function taking a module and a mesh."""
