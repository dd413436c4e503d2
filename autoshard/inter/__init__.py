"""Inter-operator planning: layer clustering, stage costs, Alpa's stage DP, pipeline schedules."""
