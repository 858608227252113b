"""The laptop world: a seeded renderer of shapes, a caption grammar in GenEval's task families, a held-out split."""
