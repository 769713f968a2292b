"""The whole-run answers of ``PipelineCosts`` that a test's synthetic costs rarely care about: no
static memory, nothing after the pipeline, unit FLOPs; subclasses price the actions."""


class SyntheticCosts:
    static = 0.0
    hbm = 1e12

    def static_bytes(self, rank):
        return self.static

    def after_pipeline(self, rank):
        return 0.0

    def model_flops(self):
        return 1.0

    def peak_flops(self):
        return 1.0

    def hbm_bytes(self):
        return self.hbm
