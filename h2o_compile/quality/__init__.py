"""Quality of a cache policy: streaming perplexity and generation agreement against the full cache."""
