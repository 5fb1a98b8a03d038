"""Reference-style baseline answers (`naivegenerate`, one token per base forward) in the same format as
`gen_ea_answer`; see that module for the options.

    python -m eagle.evaluation.gen_baseline_answer --answer-file out/answers/vanilla.jsonl
"""

from .gen_ea_answer import main

if __name__ == "__main__":
    main(baseline=True)
