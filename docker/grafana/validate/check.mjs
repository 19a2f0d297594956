// Type-check Grafana dashboard JSON files against Grafana's own schema (@grafana/schema) with the TypeScript
// compiler (tests/deploy/test_dashboard_schema.py runs it). Each panel becomes an object literal typed as a time
// series panel with Prometheus targets, the rest of the dashboard one typed as a Dashboard, so tsc reports wrong
// types, missing required fields and unknown keys (excess-property checks) per panel (tsc stops at the first
// error inside one literal).
//   node check.mjs FILE.json...      exit 0 when every file checks, 1 with the errors otherwise
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import ts from "typescript";

const here = path.dirname(fileURLToPath(import.meta.url));
const out = path.join(here, ".generated");
fs.mkdirSync(out, { recursive: true });
const HEADER = `import type { Dashboard, DataQuery, Panel } from "@grafana/schema";
import type { Options as TimeSeriesOptions, FieldConfig as TimeSeriesFieldConfig } from "@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen";
// a Prometheus query (the datasource plugin's own fields beyond DataQuery)
interface PromTarget extends DataQuery { expr: string; legendFormat?: string; range?: boolean; instant?: boolean; format?: "time_series" | "table" | "heatmap"; }
type TimeSeriesPanel = Panel<TimeSeriesOptions, TimeSeriesFieldConfig> & { type: "timeseries"; targets: PromTarget[]; options: TimeSeriesOptions };
// the schema's TypeScript enums as the string values the JSON holds (an enum is not assignable from its value)
type Loose<T> = T extends string ? \`\${T}\` : T extends number ? T : T extends boolean ? T
  : T extends (infer U)[] ? Loose<U>[] : T extends object ? { [K in keyof T]: Loose<T[K]> } : T;
`;
const files = process.argv.slice(2);
if (files.length === 0) { console.error("usage: node check.mjs FILE.json..."); process.exit(2); }
const roots = [];
const where = new Map(); // generated file -> [[first line, label]] of its literals
for (const [n, file] of files.entries()) {
  const { panels = [], ...rest } = JSON.parse(fs.readFileSync(file, "utf8"));
  let text = HEADER;
  const spans = [];
  const add = (label, decl, value) => {
    spans.push([text.split("\n").length, label]);
    text += `export const ${decl} =\n${JSON.stringify(value, null, 2)};\n`;
  };
  add("dashboard", `dashboard: Loose<Omit<Dashboard, "panels">>`, rest);
  panels.forEach((p, i) => add(`panel ${i + 1} (${JSON.stringify(p.title ?? "")})`, `panel${i}: Loose<TimeSeriesPanel>`, p));
  const tsFile = path.join(out, `dashboard${n}.ts`);
  fs.writeFileSync(tsFile, text);
  roots.push(tsFile);
  where.set(path.resolve(tsFile), { file, spans });
}
const program = ts.createProgram(roots, {
  strict: true, noEmit: true, target: ts.ScriptTarget.ES2020, module: ts.ModuleKind.ESNext,
  moduleResolution: ts.ModuleResolutionKind.Bundler, skipLibCheck: true, types: [],
});
const diagnostics = ts.getPreEmitDiagnostics(program);
for (const d of diagnostics) {
  const message = ts.flattenDiagnosticMessageText(d.messageText, "\n  ");
  const info = d.file && where.get(path.resolve(d.file.fileName));
  if (info) {
    const line = d.file.getLineAndCharacterOfPosition(d.start ?? 0).line + 1;
    const label = info.spans.filter(([first]) => first <= line).pop()?.[1] ?? "header";
    console.error(`${info.file}: ${label}: ${message}`);
  } else {
    console.error(d.file ? `${d.file.fileName}: ${message}` : message);
  }
}
console.log(`${files.length} dashboard(s), ${diagnostics.length} error(s)`);
process.exit(diagnostics.length ? 1 : 0);
