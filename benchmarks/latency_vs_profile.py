"""Print the analytic latency model's error against the authors' A100 OPT profile."""

from distserve.latency.validation import compare_to_profile


def main() -> None:
    for serving_mode in ("disaggregated", "colocated"):
        print(f"serving mode {serving_mode}")
        print(f"{'model':20} {'tp':>3} {'phase':8} {'max err':>8} {'mean err':>8} {'points':>6}")
        for e in compare_to_profile(serving_mode):
            print(
                f"{e.model_name:20} {e.tp:3d} {e.phase:8} {e.max_error:8.1%} {e.mean_error:8.1%} {e.num_points:6d}"
            )


if __name__ == "__main__":
    main()
